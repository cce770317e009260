"""Speed-aware expert re-placement between steps (moe.replace_every), on gloo ranks.

Two copies of one tiny Mixtral train side by side in one world on the same batches, AdamW,
fp32, under skewed routing (a gate bias makes experts 0 and 1 hot; Colossal-AI's contiguous
layout puts both on ep rank 0, the slow one: speeds [0.5, 1]):
- ``fixed``: the even placement throughout;
- ``moving``: ``replace_every: 2``, so after step 1 the controller re-places the experts from
  the measured loads and moves weights and AdamW state.
Checks:
- the decision is the brute-force optimum of the measured loads: no placement of the 4
  experts (capacity 4) has a smaller slowest-rank work (enumerated here, independently), it
  moved, and the record is identical on every rank;
- every step's loss is equal in the two runs (fp32 chain tolerance), and after four steps
  every expert's weights and AdamW moments, collected by global expert index from wherever
  they live, and every dense weight are equal: a re-placement changes where the arithmetic
  runs, not what it computes;
- an expert checkpoint taken under the even placement loads under the new one and gives
  the same outputs (checkpoints round-trip across placements).

Under bf16 and fp16 (Colossal-AI's AMP wrapper: the torch optimizer steps fp32 masters, its
state keyed by them), the same two runs, watched around the move:
- up to the move the runs are one computation: the moving run's experts (bf16/fp16 weight,
  fp32 master, AdamW state, by global expert index) equal the fixed run's bit for bit;
- right after the move they equal what the old holders had before it, bit for bit;
- the wrapper's maps (working <-> master), the torch optimizer's groups and state, and fp16's
  overflow list name exactly the tensors each rank holds afterwards (none of a moved-away
  expert left to step or leak), and every working weight is its master rounded, exactly;
- the losses after the move agree within one working-dtype rounding per chained forward op.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.distributed.test_moe_plugin import EXPERTS, K_MAX, LAYERS, PER_RANK, SEQ, _gates, _model
from tests.tolerances import chain_atol, transformer_depth

SPEEDS = [0.5, 1.0]
HOT = torch.tensor([3.0, 3.0, 0.0, 0.0])


def _build(replace_every: int, world_size: int, precision: str = "fp32"):  # type: ignore[no-untyped-def]
    from colossalai.booster import Booster

    from colossal_hetero.config.moe import MoeConfig
    from colossal_hetero.config.parallel import ParallelConfig
    from colossal_hetero.config.schema import ClusterConfig, DeviceSpec, HeteroConfig, PlanConfig
    from colossal_hetero.moe.block import HeteroEPMixtralSparseMoeBlock
    from colossal_hetero.plugin import HeteroParallelPlugin

    devices = [DeviceSpec(speed=SPEEDS[r % 2]) for r in range(world_size)]
    config = HeteroConfig(
        parallel=ParallelConfig(ep=2, precision=precision),  # type: ignore[arg-type]
        moe=MoeConfig(chunk_kib=1, replace_every=replace_every),
        cluster=ClusterConfig(devices=devices),
        plan=PlanConfig(mode="even"),  # the width planner has nothing to plan at tp = 1
    )
    plugin = HeteroParallelPlugin(config)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, *_ = Booster(plugin=plugin).boost(model, optimizer)
    for gate in _gates(model.unwrap()):
        # prepend: before the load meter's hook, which must count the routing really used
        gate.register_forward_hook(lambda m, i, out: out + HOT, prepend=True)
    blocks = [m for m in model.modules() if isinstance(m, HeteroEPMixtralSparseMoeBlock)]
    return plugin, model, optimizer, blocks


def _check(rank: int, world_size: int, device: torch.device) -> None:
    from colossal_hetero.moe.replace import expert_state, load_expert_state

    fixed = _build(0, world_size)
    moving = _build(2, world_size)
    before = expert_state(fixed[3])  # taken under the even placement
    generator = torch.Generator().manual_seed(3)
    tol = chain_atol(transformer_depth(LAYERS) + 4, K_MAX, torch.float32, 10.0)
    for _ in range(4):
        batch = torch.randint(0, 256, (world_size * PER_RANK, SEQ), generator=generator)
        ids = batch.split(PER_RANK)[rank]
        losses = []
        for _, model, optimizer, _ in (fixed, moving):
            loss = model(input_ids=ids, labels=ids).loss
            optimizer.backward(loss)  # what Booster.backward does
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        assert abs(losses[0] - losses[1]) <= tol, losses
    records = moving[0].moe_replacer.writer.records
    assert len(records) == 2 and records[0]["layers"][0]["moved"], records
    _check_optimal(records[0])
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, records)
    assert all(other == records for other in everyone)
    assert any(b.placement.device_of != (0, 0, 1, 1) for b in moving[3])
    _compare_state(fixed, moving, tol)
    _check_roundtrip(fixed, moving, before, load_expert_state, expert_state, rank, tol)
    for plugin, *_ in (fixed, moving):
        plugin.close()


def _check_optimal(record: dict) -> None:  # type: ignore[no-untyped-def]
    """No assignment of the experts to the two ranks (at most 4 each) beats the decision."""
    for layer in record["layers"]:
        loads = layer["loads"]
        best = min(
            max(sum(loads[e] for e in range(EXPERTS) if a[e] == d) / SPEEDS[d] for d in (0, 1))
            for a in itertools.product((0, 1), repeat=EXPERTS)
        )
        assert layer["max_work_after"] == pytest.approx(best, rel=1e-12), layer
        assert layer["max_work_after"] < layer["max_work_before"], layer


def _compare_state(fixed, moving, tol: float) -> None:  # type: ignore[no-untyped-def]
    from colossal_hetero.moe.replace import expert_state

    a, b = expert_state(fixed[3], fixed[2]), expert_state(moving[3], moving[2])
    assert sorted(a) == sorted(b) and len(a) == LAYERS * EXPERTS * 3
    for key in a:
        torch.testing.assert_close(b[key]["value"], a[key]["value"], rtol=0, atol=tol, msg=key)
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                b[key]["optim"][name], a[key]["optim"][name], rtol=0, atol=tol, msg=key
            )
    dense_a = dict(fixed[1].unwrap().named_parameters())
    for name, p in moving[1].unwrap().named_parameters():
        if ".experts." not in name:
            torch.testing.assert_close(p, dense_a[name], rtol=0, atol=tol, msg=name)


def _check_roundtrip(fixed, moving, before, load, gather, rank: int, tol: float) -> None:  # type: ignore[no-untyped-def]
    """Load the even-placement checkpoint into both models; same outputs afterwards."""
    for *_, blocks in (fixed, moving):
        load(blocks, before)
    after = gather(moving[3])
    for key, value in before.items():
        assert torch.equal(after[key]["value"], value["value"]), key
    ids = torch.arange(SEQ).remainder(256).unsqueeze(0)
    with torch.no_grad():
        outs = [model.eval()(input_ids=ids).logits for _, model, _, _ in (fixed, moving)]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=tol)


def _check_mixed(rank: int, world_size: int, device: torch.device) -> None:
    """bf16 and fp16 (the AMP wrapper) in turn, each as in :func:`_check_precision`."""
    for precision in ("bf16", "fp16"):
        _check_precision(rank, world_size, precision)


def _check_precision(rank: int, world_size: int, precision: str) -> None:
    fixed, moving = _build(0, world_size, precision), _build(2, world_size, precision)
    moves: list = []
    _watch(moving, fixed, moves)
    generator = torch.Generator().manual_seed(3)
    losses: list[list[float]] = [[], []]
    for _ in range(4):
        batch = torch.randint(0, 256, (world_size * PER_RANK, SEQ), generator=generator)
        step_both(fixed, moving, batch.split(PER_RANK)[rank], losses)
    assert len(moves) == 1, len(moves)  # after step 1; step 3's decision keeps the placement
    before, reference, after = moves[0]
    _assert_same(before, reference, "up to the move the two runs are one computation")
    _assert_same(after, before, "the move")
    assert all(set(e["optim"]) == {"step", "exp_avg", "exp_avg_sq"} for e in after.values())
    for run in (fixed, moving):
        _check_bookkeeping(run, precision)
    # After the move both runs step from equal state (checked above); a forward under the new
    # placement may sum an expert's outputs into a token in another order, and each of the
    # forward's chained ops rounds to the working dtype: the loss may differ by one rounding
    # per op (chain_atol with k=2: two orders of one sum). Steps 0-1 are one computation.
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    tol = chain_atol(transformer_depth(LAYERS, backward=False), 2, dtype, 10.0)
    assert losses[1][:2] == losses[0][:2], losses
    for got, want in zip(losses[1][2:], losses[0][2:], strict=True):
        assert abs(got - want) <= tol, (precision, losses, tol)
    for plugin, *_ in (fixed, moving):
        plugin.close()


def step_both(fixed, moving, ids: torch.Tensor, losses: list[list[float]]) -> None:  # type: ignore[no-untyped-def]
    """One training step of each run (``(plugin, model, optimizer, ...)``) on ``ids``; each
    run's loss appended to its list in ``losses``."""
    for run, out in zip((fixed, moving), losses, strict=True):
        loss = run[1](input_ids=ids, labels=ids).loss
        run[2].backward(loss)
        run[2].step()
        run[2].zero_grad()
        out.append(float(loss))


def _watch(moving, fixed, moves: list) -> None:  # type: ignore[no-untyped-def]
    """Around the moving run's re-placement: its experts' state before and after the move and
    the fixed run's at the same step (placement-free keys, gathered over the ep group)."""
    from colossal_hetero.moe.replace import expert_state

    replacer = moving[0].moe_replacer
    inner = replacer.on_step_end

    def watched(step: int, timing) -> None:  # type: ignore[no-untyped-def]
        placements = [b.placement for b in moving[3]]
        before, reference = expert_state(moving[3], moving[2]), expert_state(fixed[3], fixed[2])
        inner(step, timing)
        if placements != [b.placement for b in moving[3]]:
            moves.append((before, reference, expert_state(moving[3], moving[2])))

    replacer.on_step_end = watched


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want) and len(got) == LAYERS * EXPERTS * 3, what
    for key, entry in want.items():
        other = got[key]
        assert sorted(other) == sorted(entry) and sorted(other["optim"]) == sorted(entry["optim"])
        for name in ("value", "master"):
            assert torch.equal(other[name], entry[name]), (what, key, name)
        for name, value in entry["optim"].items():
            same = torch.equal(other["optim"][name], value) if torch.is_tensor(value) else None
            assert same if same is not None else other["optim"][name] == value, (what, key, name)


def _check_bookkeeping(run, precision: str) -> None:  # type: ignore[no-untyped-def]
    """The wrapper's maps, the torch optimizer's groups and state (and fp16's overflow list)
    name exactly the tensors of the experts this rank holds now (plus the dense ones); each
    working weight is its master rounded to the working dtype."""
    _, model, optimizer, blocks = run
    params = list(model.unwrap().parameters())
    to_master, to_working = optimizer.working_to_master_map, optimizer.master_to_working_map
    assert sorted(map(id, to_master)) == sorted(map(id, params))
    masters = [to_master[p] for p in params]
    assert len(to_working) == len(params) and all(
        to_working[m] is p for p, m in zip(params, masters, strict=True)
    )
    stepped = [m for group in optimizer.optim.param_groups for m in group["params"]]
    assert sorted(map(id, stepped)) == sorted(map(id, masters))
    assert set(map(id, optimizer.optim.state)) <= set(map(id, masters))
    if precision == "fp16":
        assert sorted(map(id, optimizer.mixed_precision.params)) == sorted(map(id, params))
    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[precision])
    for p in (p for block in blocks for p in block.expert_parameters()):
        assert p.dtype == dtype and to_master[p].dtype == torch.float32
        assert torch.equal(p.data, to_master[p].to(dtype))


@pytest.mark.timeout(300)
def test_replacement_under_bf16_and_fp16_moves_masters_exactly() -> None:
    run_distributed(_check_mixed, 2, force_cpu=True)


@pytest.mark.timeout(300)
def test_replacement_mid_run_equals_fixed_placement() -> None:
    run_distributed(_check, 2, force_cpu=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_replacement_ep2_dp2() -> None:
    """EP=2 x DP=2: each replica's ep group moves the same experts; the expert gradient
    reducer is re-bound to the moved parameters and still reduces over the replicas."""
    run_distributed(_check, 4, force_cpu=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_replacement_mixed_precision_ep2_dp2() -> None:
    """bf16 and fp16 at EP=2 x DP=2: both replicas move their masters alike."""
    run_distributed(_check_mixed, 4, force_cpu=True)
