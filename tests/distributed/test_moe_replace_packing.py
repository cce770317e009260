"""Packing-aware re-placement (moe.packing with moe.replace_every), on gloo ranks.

Two copies of one tiny Mixtral (4 experts, top-2, packing on) train side by side in one world
on the same batches, AdamW, fp32, equal speeds. A gate bias routes every even token (flattened
index) to experts {0, 2} and every odd one to {1, 3}, while Colossal-AI's contiguous layout
holds {0, 1} and {2, 3}: every token then has one expert on each ep rank, so packing saves
nothing. Loads are equal, so the compute objective has no reason to move; only the packed
sends can.
- ``fixed``: the even placement throughout;
- ``moving``: ``replace_every: 2``, minimum gain 0 (any strictly lower objective moves: how
  much lower depends on measured costs, see below), so after step 1 the controller decides
  from the measured routing histogram and costs.
Checks:
- the decision moved every layer so that co-selected experts share a rank ({0, 2} and
  {1, 3}), chosen by the packing objective, and the records are identical on every rank;
- the record's predicted packed rows equal, exactly, the rows the blocks' packing counters
  accounted over the same steps (summed over the world), before the move (steps 0-1) and
  after it (steps 2-3, the next decision's "before"); the accounted rows and bytes per step
  drop after the move (by half: an even token from rank 0 now stays there);
- the replacer's checkpoint state carries the routing histogram (one more step's tokens);
- the move is exact (every expert's weights and AdamW state right after it equal the old
  holder's before it, bit for bit), and training continues as the fixed run does: equal
  losses (steps 0-1 exactly, later within the fp32 chain tolerance: packing sums an expert's
  outputs per rank, whose grouping changes with the placement) and equal final state.

Why minimum gain 0 here: the objective's drop is ``packed sends * seconds_per_send`` against
the compute, both measured; at hidden 16 on loopback gloo a send costs far less than a row's
compute, so the default 10% would (rightly) keep the placement, and the outcome would depend
on timings. The hysteresis itself is tested in tests/unit/test_moe_packing_replace.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.distributed.test_moe_plugin import K_MAX, LAYERS, PER_RANK, SEQ, _gates, _model
from tests.distributed.test_moe_replace import _compare_state, _watch, step_both
from tests.tolerances import chain_atol, transformer_depth

PAIRS = torch.tensor([[8.0, 0.0, 8.0, 0.0], [0.0, 8.0, 0.0, 8.0]])  # even / odd tokens


def _bias(module, inputs, out):  # type: ignore[no-untyped-def]
    return out + PAIRS[torch.arange(out.shape[0]) % 2]


def _build(replace_every: int, world_size: int):  # type: ignore[no-untyped-def]
    from colossalai.booster import Booster

    from colossal_hetero.config.moe import MoeConfig
    from colossal_hetero.config.parallel import ParallelConfig
    from colossal_hetero.config.schema import ClusterConfig, DeviceSpec, HeteroConfig, PlanConfig
    from colossal_hetero.moe.block import HeteroEPMixtralSparseMoeBlock
    from colossal_hetero.plugin import HeteroParallelPlugin

    config = HeteroConfig(
        parallel=ParallelConfig(ep=2),
        moe=MoeConfig(chunk_kib=1, replace_every=replace_every, packing=True),
        cluster=ClusterConfig(devices=[DeviceSpec(speed=1.0) for _ in range(world_size)]),
        plan=PlanConfig(mode="even"),
    )
    plugin = HeteroParallelPlugin(config)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, *_ = Booster(plugin=plugin).boost(model, optimizer)
    for gate in _gates(model.unwrap()):
        gate.register_forward_hook(_bias, prepend=True)  # before the meters count
    blocks = [m for m in model.modules() if isinstance(m, HeteroEPMixtralSparseMoeBlock)]
    if plugin.moe_replacer is not None:
        plugin.moe_replacer.min_gain = 0.0
    return plugin, model, optimizer, blocks


def _counters(blocks) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Per layer: the world's accounted packed rows and bytes so far (packed.py's counters)."""
    mine = torch.tensor(
        [[b.packing_stats.rows_packed, b.packing_stats.bytes_packed] for b in blocks]
    )
    dist.all_reduce(mine)
    return mine.tolist()


def _check(rank: int, world_size: int, device: torch.device) -> None:
    fixed, moving = _build(0, world_size), _build(2, world_size)
    moves: list = []
    _watch(moving, fixed, moves)
    generator = torch.Generator().manual_seed(5)
    tol = chain_atol(transformer_depth(LAYERS) + 4, K_MAX, torch.float32, 10.0)
    losses: list[list[float]] = [[], []]
    counters = []
    for _ in range(4):
        batch = torch.randint(0, 256, (world_size * PER_RANK, SEQ), generator=generator)
        ids = batch.split(PER_RANK)[rank]
        step_both(fixed, moving, ids, losses)
        counters.append(_counters(moving[3]))
    records = moving[0].moe_replacer.writer.records
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, records)
    assert all(other == records for other in everyone)
    assert len(records) == 2 and all(r["objective"] == "packing" for r in records), records
    for layer, block in enumerate(moving[3]):
        decided = records[0]["layers"][layer]
        assert decided["moved"] and decided["search"] == "exact", decided
        groups = sorted(sorted(g) for g in decided["placement"])
        assert groups == [[0, 2], [1, 3]], decided
        assert block.placement.record()["devices"] == decided["placement"]
        first = counters[1][layer]
        second = [a - b for a, b in zip(counters[3][layer], first, strict=True)]
        assert decided["before"]["packed_rows"] == first[0], (decided, first)
        assert decided["before"]["packed_bytes"] == first[1], (decided, first)
        assert records[1]["layers"][layer]["before"]["packed_rows"] == second[0]
        assert decided["after"]["packed_rows"] == second[0]  # same routing in both intervals
        tokens = 2 * world_size * PER_RANK * SEQ  # two steps
        assert first[0] == tokens and second[0] == tokens // 2, (first, second)
        assert second[1] < first[1]
    assert len(moves) == 1
    before, _, after = moves[0]
    _same(after, before)
    assert losses[1][:2] == losses[0][:2], losses
    for got, want in zip(losses[1][2:], losses[0][2:], strict=True):
        assert abs(got - want) <= tol, (losses, tol)
    _compare_state(fixed, moving, tol)
    _check_resume_state(moving, ids, world_size)
    for plugin, *_ in (fixed, moving):
        plugin.close()


def _check_resume_state(moving, ids, world_size: int) -> None:  # type: ignore[no-untyped-def]
    """One more step (no decision): the replacer's checkpoint state holds the world's routing
    histogram of that step (every token of every layer, once); restoring it and asking again
    gives the same counts (kept once, on rank 0)."""
    _, model, optimizer, _ = moving
    optimizer.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()
    replacer = moving[0].moe_replacer
    state = replacer.state()
    assert int(state["routing"].sum()) == LAYERS * world_size * PER_RANK * SEQ
    replacer.restore(state)
    assert torch.equal(replacer.state()["routing"], state["routing"])


def _same(got: dict, want: dict) -> None:
    """Every expert tensor and its AdamW state, by placement-free key, bit for bit."""
    assert sorted(got) == sorted(want) and want
    for key, entry in want.items():
        assert torch.equal(got[key]["value"], entry["value"]), key
        assert (
            sorted(got[key]["optim"]) == sorted(entry["optim"]) == ["exp_avg", "exp_avg_sq", "step"]
        )
        for name, value in entry["optim"].items():
            assert torch.equal(got[key]["optim"][name], value), (key, name)


@pytest.mark.timeout(300)
def test_packing_replacement_colocates_coselected_experts() -> None:
    run_distributed(_check, 2, force_cpu=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_packing_replacement_ep2_dp2() -> None:
    """EP=2 x DP=2: both replicas' ep groups decide and move alike from the world's counts."""
    run_distributed(_check, 4, force_cpu=True)
