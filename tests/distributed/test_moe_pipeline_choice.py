"""The a2a/expert pipelining choice through the plugin (moe.pipeline_auto; 2 gloo ranks, EP=2).

Four training steps of a tiny Mixtral with ``pipeline_chunks: 3`` and the choice on. Checks:
- after step ``DECIDE_AFTER`` every rank logged the same decision record (inputs measured in
  the steps after the first, agreed over the world, and the prediction of every candidate);
- the decision is what the pure model (moe/pipeline_model.py) gives for the logged inputs,
  and the agreed rows are what a block dispatches (tokens x top-k of one rank's shard);
- the steps up to the model's choice ran one range (1 + 4 a2a's per layer); a choice of n > 1
  ranges is tried first, n and one range alternating for ``TRIAL_STEPS`` steps each (4 a2a's
  per layer for one range: the counts fold into the dispatch once measuring is over), and kept
  only if its agreed median step was faster; every rank runs the same counts and every block
  holds the final number.
A second test, on a one-rank gloo world with fake blocks and hand-built logs, checks the
give-up (one range for good when no step was measured) and a compute-bound case by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colossal_hetero.utils.teardown import close_process_group
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
    from colossal_hetero.moe.pipeline_choice import DECIDE_AFTER, TRIAL_STEPS
    from colossal_hetero.moe.pipeline_model import (
        MIN_GAIN,
        PROPOSE_GAIN,
        ExchangeInputs,
        choose_ranges,
    )
    from colossal_hetero.plugin import HeteroParallelPlugin

    moe = MoeConfig(chunk_kib=1, pipeline_chunks=3, pipeline_auto=True)
    plugin = HeteroParallelPlugin(HeteroConfig(parallel=ParallelConfig(ep=2), moe=moe))
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    generator = torch.Generator().manual_seed(3)
    counts = []
    steps = DECIDE_AFTER + 2 * TRIAL_STEPS + 2
    for _ in range(steps):
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
    n, again = choose_ranges(inputs, 3, margin=PROPOSE_GAIN)
    assert again["predicted_s"] == record["predicted_s"]
    assert set(record["predicted_s"]) == {1, 2, 3}
    after = steps - DECIDE_AFTER - 1  # steps after the model's choice
    if n == 1:
        assert "trial" not in record and record["ranges"] == 1
        assert record["decided_at"] == DECIDE_AFTER
        ran = [1] * after
    else:
        trial = record["trial"]
        assert record["decided_at"] == DECIDE_AFTER + 2 * TRIAL_STEPS
        faster = trial["proposed_s"] < (1 - MIN_GAIN) * trial["one_range_s"]
        assert record["ranges"] == (n if faster else 1)
        ran = [n, 1] * TRIAL_STEPS + [record["ranges"]] * (after - 2 * TRIAL_STEPS)
    # Once measuring is over one range folds the routing counts into the dispatch
    # (moe/folded.py): 4 a2a's per layer; n ranges 1 + 4n.
    expected = [LAYERS * 4 if r == 1 else LAYERS * (1 + 4 * r) for r in ran]
    assert counts == [LAYERS * 5] * (DECIDE_AFTER + 1) + expected, (counts, n)
    blocks = [m for m in model.modules() if isinstance(m, HeteroEPMixtralSparseMoeBlock)]
    assert len(blocks) == LAYERS and all(b.pipeline_chunks == record["ranges"] for b in blocks)
    plugin.close()


@pytest.mark.timeout(300)
def test_pipeline_choice_is_agreed_logged_and_applied() -> None:
    run_distributed(_check, 2, force_cpu=True)


class _FakeBlock:
    """What the chooser reads of a block: rows dispatched, hidden size, a held expert's dtype."""

    def __init__(self, rows: int) -> None:
        self.dispatched_rows, self.hidden_dim, self.held = rows, 8, (0,)
        self.experts = [torch.nn.Linear(8, 8)]
        self.pipeline_chunks = 1


def _single_rank_choices() -> None:
    from colossal_hetero.moe.pipeline_choice import (
        DECIDE_AFTER,
        GIVE_UP_AFTER,
        TRIAL_STEPS,
        PipelineChooser,
    )
    from colossal_hetero.moe.pipeline_model import ExchangeInputs, choose_ranges

    # No forward ever dispatched: one range for good at GIVE_UP_AFTER, nothing before.
    idle = PipelineChooser([_FakeBlock(0)], 3)
    got = [idle.on_step_end(step, []) for step in range(GIVE_UP_AFTER + 1)]
    assert got[:-1] == [None] * GIVE_UP_AFTER and got[-1] is not None
    assert got[-1]["ranges"] == 1 and "reason" in got[-1]
    # One layer by hand (ms): counts 0.1 (alpha); data a2a's 1.1 each for 1024 B, 1 ms beyond
    # alpha (so 2048 B, 64 rows of 8 fp32, take 2 ms); expert gaps 5 ms forward, 10 backward.
    # n=1: (2 * 2.1 + 5) + (2 * 2.1 + 10) = 23.4 ms; n=3: a = 0.1 + 2/3 <= c, so 2a + C per
    # pass: 6.53 + 11.53 = 18.07 ms (n=2: 19.4 ms): 3 ranges.
    calls = [(0.0, 0.1, 8), (0.1, 1.2, 1024), (6.2, 7.3, 1024), (8.0, 9.1, 1024)]
    calls.append((19.1, 20.2, 1024))
    log = [("a2a", "ep", i, a / 1e3, b / 1e3, n) for i, (a, b, n) in enumerate(calls)]
    blocks = [_FakeBlock(64)]
    chooser = PipelineChooser(blocks, 3)
    records = [chooser.on_step_end(step, log) for step in range(DECIDE_AFTER + 2)]
    record = records[DECIDE_AFTER]
    assert records[:DECIDE_AFTER] == [None] * DECIDE_AFTER and records[-1] is None
    assert record is not None and record["measured_steps"] == DECIDE_AFTER  # step 0: warm-up
    inputs = ExchangeInputs(**record["inputs"])
    assert inputs.rows == 64 and inputs.row_bytes == 8 * 4
    assert abs(inputs.alpha - 1e-4) < 1e-9 and abs(inputs.fwd_row_s * 64 - 5e-3) < 1e-9
    assert abs(record["predicted_s"][1] - 23.4e-3) < 1e-9
    assert abs(record["predicted_s"][3] - (2 * (0.1 + 2 / 3) * 2 + 15) * 1e-3) < 1e-9
    assert record["ranges"] == choose_ranges(inputs, 3)[0] == 3 == blocks[0].pipeline_chunks
    assert "trial" not in record  # no step times: the proposal is kept untried
    # With step times the proposal of 3 ranges is tried against one range, alternating, and
    # kept only if its median step is faster (one rank: its own medians).
    # (0.0194 / 0.02 = 0.97: faster, but within the 5% margin: one range.)
    for proposed_s, one_s, final in ((0.02, 0.03, 3), (0.03, 0.02, 1), (0.0194, 0.02, 1)):
        blocks = [_FakeBlock(64)]
        chooser = PipelineChooser(blocks, 3)
        ran, got = [], []
        for step in range(DECIDE_AFTER + 1 + 2 * TRIAL_STEPS):
            ran.append(blocks[0].pipeline_chunks)  # the setting this step runs
            seconds = proposed_s if blocks[0].pipeline_chunks == 3 else one_s
            got.append(chooser.on_step_end(step, log, seconds))
        assert ran == [1] * (DECIDE_AFTER + 1) + [3, 1] * TRIAL_STEPS
        assert got[:-1] == [None] * (DECIDE_AFTER + 2 * TRIAL_STEPS) and got[-1] is not None
        trial = got[-1]["trial"]
        assert (trial["proposed_s"], trial["one_range_s"]) == (proposed_s, one_s)
        assert got[-1]["ranges"] == final == blocks[0].pipeline_chunks
        assert got[-1]["decided_at"] == DECIDE_AFTER + 2 * TRIAL_STEPS


def test_chooser_gives_up_and_decides_by_hand(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        _single_rank_choices()
    finally:
        close_process_group()
