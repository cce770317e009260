"""Expert packing (moe.packing) in the expert-parallel Mixtral block, EP=2 on 2 gloo ranks.

The plain Booster loop of test_moe_plugin with packing on, against the single-process model
(EP=1, the independent reference) on the same shards, under the three routing cases (the
model's own, skewed with an expert no token reaches, and zero: ep rank 1 receives nothing):
- each rank's loss equals the reference's on its shard, every gradient after the flush equals
  the reference's, and the parameters after the SGD steps too (packing changes only the order
  of the per-token sum over experts: within the chain tolerance);
- the packed rows and bytes the block accounts equal a brute-force count from the routing
  (``packing.a2a_sends`` with each token on its own rank): the rows a token sends to other
  ranks are its distinct remote ranks, not its remote experts;
- the same number of a2a calls on both ranks (no hang under zero routing);
- from a block's second forward the row counts ride in the dispatch (moe/folded.py: one a2a
  fewer per layer), and the last step, zero routing after three steps that send rank 0
  nothing, sends rank 0 more rows from rank 1 than the pair's capacity (the overflow goes
  point to point): still equal.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.distributed.test_moe_plugin import (
    CASES,
    EXPERTS,
    HIDDEN,
    K_MAX,
    LAYERS,
    LR,
    PER_RANK,
    SEQ,
    _bias,
    _compare_grads,
    _compare_params,
    _gates,
    _model,
    _reference_step,
)
from tests.tolerances import chain_atol, transformer_depth

PLACEMENT = [[0, 1], [2, 3]]
FAR = ("far", True, "far")
"""Every token to experts 2 and 3 (ep rank 0 receives nothing)."""
STEPS = [*CASES, FAR, FAR, FAR, CASES[2]]
"""The three routings, then three far steps and zero routing (an overflow once folded)."""
UNFOLDED, FOLDED = 5, 4
"""A2a calls per layer and step: counts, dispatch, combine, and the two backward ones."""


def _check(rank: int, world_size: int, device: torch.device) -> None:
    from colossalai.booster import Booster

    from colossal_hetero.config.moe import MoeConfig
    from colossal_hetero.config.parallel import ParallelConfig
    from colossal_hetero.config.schema import HeteroConfig
    from colossal_hetero.moe.block import HeteroEPMixtralSparseMoeBlock
    from colossal_hetero.moe.folded import capacity
    from colossal_hetero.moe.packing import a2a_sends
    from colossal_hetero.moe.placement import placement_from_groups
    from colossal_hetero.plugin import HeteroParallelPlugin

    moe = MoeConfig(chunk_kib=1, placement=PLACEMENT, packing=True)
    plugin = HeteroParallelPlugin(HeteroConfig(parallel=ParallelConfig(ep=2), moe=moe))
    model = _model()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    inner = model.unwrap()
    blocks = [m for m in inner.modules() if isinstance(m, HeteroEPMixtralSparseMoeBlock)]
    assert len(blocks) == LAYERS and all(b.packing for b in blocks)
    placement = placement_from_groups(PLACEMENT, EXPERTS)
    bias = [torch.zeros(EXPERTS)]
    routed: list[torch.Tensor] = []
    for gate in _gates(inner) + _gates(reference):
        gate.register_forward_hook(lambda m, i, out: out + bias[0])
    for gate in _gates(inner):  # after the bias hook: the routing the block really uses
        gate.register_forward_hook(lambda m, i, out: routed.append(out.topk(2, dim=-1).indices))
    generator = torch.Generator().manual_seed(1)
    for step, (case, _, skew) in enumerate(STEPS):
        batch = torch.randint(0, 256, (world_size * PER_RANK, SEQ), generator=generator)
        shards = batch.split(PER_RANK)
        ref_losses = _reference(reference, shards, skew, bias)
        bias[0] = _routing_bias(skew, rank)
        for block in blocks:
            block.packing_stats = None
        history = blocks[0].fold_history
        before = list(history.sent[0]) if history is not None else []
        routed.clear()
        loss = model(input_ids=shards[rank], labels=shards[rank]).loss
        booster.backward(loss, optimizer)
        forward = transformer_depth(LAYERS, backward=False) + 2
        tol = chain_atol(forward, K_MAX, torch.float32, abs(ref_losses[rank]))
        assert abs(float(loss) - ref_losses[rank]) <= tol, (case, float(loss), ref_losses[rank])
        optimizer.step()  # flushes the reducers first
        _compare_grads(inner, reference, case, transformer_depth(LAYERS) + 4)
        optimizer.zero_grad()
        with torch.no_grad():
            for p in reference.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)
        _check_accounting(blocks, routed, placement, a2a_sends, rank, case)
        calls = torch.tensor([sum(1 for k, *_ in plugin.moe_log.last if k == "a2a")])
        everyone = [torch.zeros_like(calls) for _ in range(world_size)]
        dist.all_gather(everyone, calls)
        assert all(int(c) == int(calls) for c in everyone), case
        assert int(calls) == LAYERS * (FOLDED if step else UNFOLDED), (step, case)
        if step == len(STEPS) - 1 and rank == 1:  # rows to rank 0 beyond the pair's capacity
            assert blocks[0].fold_history.sent[0][-1] > capacity(before), before
    _compare_params(inner, reference)
    plugin.close()


def _routing_bias(skew: str | None, shard: int) -> torch.Tensor:
    return torch.tensor([-8.0, -8.0, 8.0, 8.0]) if skew == "far" else _bias(skew, shard)


def _reference(reference, shards, skew: str | None, bias: list) -> list[float]:  # type: ignore[no-untyped-def]
    """test_moe_plugin's reference step with ``far`` routing too."""
    if skew != "far":
        return _reference_step(reference, shards, skew, bias)
    losses = []
    reference.zero_grad(set_to_none=True)
    bias[0] = _routing_bias(skew, 0)
    for shard in shards:
        loss = reference(input_ids=shard, labels=shard).loss
        (loss / len(shards)).backward()
        losses.append(float(loss))
    return losses


def _check_accounting(blocks, routed, placement, a2a_sends, rank: int, case: str) -> None:  # type: ignore[no-untyped-def]
    assert len(routed) == len(blocks), case
    rows_packed = rows_unpacked = 0
    for topk in routed:
        counts = a2a_sends(topk.numpy(), placement, token_device=[rank] * topk.shape[0])
        rows_packed += counts.packed
        rows_unpacked += counts.unpacked
    stats = [b.packing_stats for b in blocks]
    assert sum(s.rows_packed for s in stats) == rows_packed, case
    assert sum(s.rows_unpacked for s in stats) == rows_unpacked, case
    width, itemsize = 2, 4  # two experts per rank; fp32
    packed_bytes = rows_packed * (2 * HIDDEN + 2 * width) * itemsize
    assert sum(s.bytes_packed for s in stats) == packed_bytes, case
    assert sum(s.bytes_unpacked for s in stats) == rows_unpacked * 2 * HIDDEN * itemsize, case
    if case == "zero":  # experts 0 and 1 share ep rank 0: one row per token, not two
        assert 2 * rows_packed == rows_unpacked, case
    else:
        assert rows_packed <= rows_unpacked, case


@pytest.mark.timeout(300)
def test_packed_dispatch_matches_single_process() -> None:
    run_distributed(_check, 2, force_cpu=True)
