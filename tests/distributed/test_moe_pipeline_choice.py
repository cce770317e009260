"""The a2a/expert pipelining choice through the plugin (moe.pipeline_auto; 2 gloo ranks, EP=2).

Four training steps of a tiny Mixtral with ``pipeline_chunks: 3`` and the choice on. Checks:
- after step ``DECIDE_AFTER`` every rank logged the same decision record (inputs measured in
  the steps after the first, agreed over the world, and the prediction of every candidate);
- the decision is what the pure model (moe/pipeline_model.py) gives for the logged inputs,
  and the agreed rows are what a block dispatches (tokens x top-k of one rank's shard);
- the steps up to the decision ran one range (1 + 4 a2a's per layer) and the next the chosen
  number (1 + 4n per layer), on every rank, and every block holds it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.distributed.test_moe_plugin import LAYERS, PER_RANK, SEQ, _model


def _a2a_count(log) -> int:  # type: ignore[no-untyped-def]
    return sum(1 for k, *_ in log if k == "a2a")


def _check(rank: int, world_size: int, device: torch.device) -> None:
    from colossalai.booster import Booster

    from colossal_hetero.config.moe import MoeConfig
    from colossal_hetero.config.parallel import ParallelConfig
    from colossal_hetero.config.schema import HeteroConfig
    from colossal_hetero.moe.block import HeteroEPMixtralSparseMoeBlock
    from colossal_hetero.moe.pipeline_choice import DECIDE_AFTER
    from colossal_hetero.moe.pipeline_model import ExchangeInputs, choose_ranges
    from colossal_hetero.plugin import HeteroParallelPlugin

    moe = MoeConfig(chunk_kib=1, pipeline_chunks=3, pipeline_auto=True)
    plugin = HeteroParallelPlugin(HeteroConfig(parallel=ParallelConfig(ep=2), moe=moe))
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    generator = torch.Generator().manual_seed(3)
    counts = []
    for _ in range(DECIDE_AFTER + 2):
        batch = torch.randint(0, 256, (world_size * PER_RANK, SEQ), generator=generator)
        ids = batch.split(PER_RANK)[rank]
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        counts.append(_a2a_count(plugin.moe_log.last))
    record = plugin.moe_log.comm.chooser.record
    assert record is not None and record["step"] == DECIDE_AFTER
    assert record["measured_steps"] == DECIDE_AFTER  # steps 1..DECIDE_AFTER
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, record)
    assert all(other == record for other in everyone)
    inputs = ExchangeInputs(**record["inputs"])
    assert inputs.rows == PER_RANK * SEQ * 2  # tokens x top-k
    n, again = choose_ranges(inputs, 3)
    assert n == record["ranges"] and again["predicted_s"] == record["predicted_s"]
    assert set(record["predicted_s"]) == {1, 2, 3}
    assert counts == [LAYERS * 5] * (DECIDE_AFTER + 1) + [LAYERS * (1 + 4 * n)], (counts, n)
    blocks = [m for m in model.modules() if isinstance(m, HeteroEPMixtralSparseMoeBlock)]
    assert len(blocks) == LAYERS and all(b.pipeline_chunks == n for b in blocks)
    plugin.close()


@pytest.mark.timeout(300)
def test_pipeline_choice_is_agreed_logged_and_applied() -> None:
    run_distributed(_check, 2, force_cpu=True)
