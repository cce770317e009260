"""Speed-aware expert re-placement under ZeRO-1 (moe/replace_zero.py), on 4 gloo ranks.

EP=2 x DP=2, bf16, ``parallel.zero_stage`` 1 (Colossal-AI's MoE ZeRO optimizer: each expert's
fp32 master and AdamW state are flat slices over its ``moe_dp`` group), the tiny Mixtral of
test_moe_plugin, AdamW, skewed routing (a gate bias makes experts 0 and 1 hot; the even
placement puts both on ep rank 0, the slow one), ``moe.replace_every: 2``. One spawn:

- ``moving`` trains 2 steps; after step 1 the controller re-places the experts. Around that
  move every parameter's state is collected by its Hugging Face name, each fp32 master and
  state slice gathered over its ZeRO group to the full shape (here, by hand): right after the
  move every working weight, full master and AdamW state (moments and step) equals what the
  old holder had just before it, bit for bit; every working weight is its master rounded to
  bf16, exactly; and the ZeRO optimizer's bookkeeping (groups, maps, padding, gradient and
  bucket stores, ZeRO groups) names exactly the parameters each rank holds now, in the order
  a fresh optimizer at the new placement has.
- the run saves a checkpoint at the new placement (checkpoint/moe.py) and trains 2 more steps.
- ``reference`` is a fresh ZeRO-1 booster built at the new placement (``moe.placement``,
  no re-placement) that loads that checkpoint: its state equals the moved run's; its ZeRO
  groups list the parameters by name in the same order; its 2 steps' losses, and then every
  weight, master and state, equal the moved run's exactly (the same arithmetic on the same
  values: a move under ZeRO leaves nothing stale and loses nothing).

Expert tensors here have 512 elements, which a moe_dp group of 2 splits without padding (an
odd count needs an odd hidden size, which rotary attention cannot take); the slow EP=2 x DP=3
variant (6 ranks) pads each by 1, so a moved expert's padded buffer is rebuilt there. A slow
fp16 variant runs ``zero_stage: 2`` (which Colossal-AI's MoE plugin runs as ZeRO-1), and a
slow one runs test_moe_resume's trainer resume under bf16 ZeRO-1 (the restore moves the experts
back to the checkpoint's placement through moe/replace_zero.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.distributed.test_moe_checkpoint import _train
from tests.distributed.test_moe_plugin import EXPERTS, LAYERS, PER_RANK, SEQ, _gates, _model

SPEEDS = [0.5, 1.0]
HOT = torch.tensor([3.0, 3.0, 0.0, 0.0])


def _build(  # type: ignore[no-untyped-def]
    world_size: int, replace_every: int, placement: list | None = None, run: tuple = ("bf16", 1)
):
    from colossalai.booster import Booster

    from colossal_hetero.config.moe import MoeConfig
    from colossal_hetero.config.parallel import ParallelConfig
    from colossal_hetero.config.schema import ClusterConfig, DeviceSpec, HeteroConfig, PlanConfig
    from colossal_hetero.moe.block import HeteroEPMixtralSparseMoeBlock
    from colossal_hetero.plugin import HeteroParallelPlugin

    devices = [DeviceSpec(speed=SPEEDS[r % 2]) for r in range(world_size)]
    config = HeteroConfig(
        parallel=ParallelConfig(ep=2, zero_stage=run[1], precision=run[0]),
        moe=MoeConfig(chunk_kib=1, replace_every=replace_every, placement=placement or []),
        cluster=ClusterConfig(devices=devices),
        plan=PlanConfig(mode="even"),
    )
    plugin = HeteroParallelPlugin(config)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    for gate in _gates(model.unwrap()):
        gate.register_forward_hook(lambda m, i, out: out + HOT, prepend=True)
    blocks = [m for m in model.modules() if isinstance(m, HeteroEPMixtralSparseMoeBlock)]
    return plugin, booster, model, optimizer, blocks


def _full(optimizer, param, value):  # type: ignore[no-untyped-def]
    """A flat ZeRO slice of ``param`` gathered over its ZeRO group to ``param``'s shape."""
    slice_ = optimizer.working_to_master_param[id(param)]
    if not (torch.is_tensor(value) and value.dim() == 1 and value.numel() == slice_.numel()):
        return value.clone() if torch.is_tensor(value) else value  # ``step``
    group = optimizer.param_to_pg[param]
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, value.contiguous(), group=group)
    return torch.cat(parts)[: param.numel()].view(param.shape)


def _snapshot(run) -> dict:  # type: ignore[no-untyped-def]
    """Every parameter by HF name: value, full fp32 master, full AdamW state (collective:
    dense parameters first, then experts; merged over the ep group)."""
    _, _, model, optimizer, blocks = run
    named = list(model.unwrap().named_parameters())
    mine = {}
    for experts in (False, True):
        for name, p in named:
            if (".experts." in name) != experts:
                continue
            master = optimizer.working_to_master_param[id(p)]
            state = optimizer.optim.state.get(master, {})
            mine[name] = {
                "value": p.detach().clone(),
                "master": _full(optimizer, p, master.detach()),
                "state": {k: _full(optimizer, p, v) for k, v in state.items()},
            }
    everyone: list = [None] * dist.get_world_size(blocks[0].ep_group)
    dist.all_gather_object(everyone, mine, group=blocks[0].ep_group)
    return {name: entry for part in everyone for name, entry in part.items()}


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name, entry in want.items():
        other = got[name]
        assert sorted(other["state"]) == sorted(entry["state"]), (what, name)
        for key in ("value", "master"):
            assert torch.equal(other[key], entry[key]), (what, name, key)
        for key, value in entry["state"].items():
            assert torch.equal(other["state"][key], value), (what, name, key)


def _watch(run, moves: list) -> None:  # type: ignore[no-untyped-def]
    replacer = run[0].moe_replacer
    inner = replacer.on_step_end

    def watched(step: int, timing) -> None:  # type: ignore[no-untyped-def]
        placements = [b.placement for b in run[4]]
        before = _snapshot(run)
        inner(step, timing)
        if placements != [b.placement for b in run[4]]:
            moves.append((before, _snapshot(run)))

    replacer.on_step_end = watched


def _check_bookkeeping(run) -> list[list[str]]:  # type: ignore[no-untyped-def]
    """Every ZeRO structure names exactly the parameters this rank holds (experts in the
    experts' ZeRO group, dense ones in the dense group); returns the names of each group's
    working list and each ZeRO group's parameter list, in order."""
    from colossalai.tensor.moe_tensor.api import is_moe_tensor

    _, _, model, zero, _ = run
    named = {id(p): n for n, p in model.unwrap().named_parameters()}
    params = [p for _, p in model.unwrap().named_parameters()]
    ids = sorted(named)
    assert sorted(zero.working_to_master_param) == ids and sorted(zero._padding_map) == ids
    assert sorted(zero.pid_to_grad_store) == ids and sorted(zero.pid_to_bucket_store) == ids
    assert sorted(map(id, zero.param_to_pg)) == ids
    assert sorted(map(id, zero._working_param_to_padded_working_param)) == ids
    assert sorted(id(p) for ps in zero.pg_to_param_list.values() for p in ps) == ids
    dense_pg, expert_pg = list(zero.pg_to_param_list)  # dp and moe_dp differ at EP=2 x DP=2
    masters = {id(zero.working_to_master_param[id(p)]) for p in params}
    assert sorted(zero.master_to_working_param) == sorted(masters)
    for p in params:
        expert = ".experts." in named[id(p)]
        assert zero.master_to_working_param[id(zero.working_to_master_param[id(p)])] is p
        padded = zero._working_param_to_padded_working_param[p]
        assert padded.data_ptr() == p.data_ptr()
        assert padded.numel() == p.numel() + zero._padding_map[id(p)]
        assert zero.param_to_pg[p] is (expert_pg if expert else dense_pg)
        assert is_moe_tensor(p) == expert
        assert zero.pid_to_grad_store[id(p)] is zero.pg_to_grad_store[zero.param_to_pg[p]]
        assert zero.pid_to_bucket_store[id(p)] is zero.pg_to_bucket_store[zero.param_to_pg[p]]
    working = [p for ws in zero._working_param_groups.values() for p in ws]
    assert sorted(map(id, working)) == ids
    for g, ws in zero._working_param_groups.items():
        ms = zero._master_param_groups_of_current_rank[g]
        assert zero.optim.param_groups[g]["params"] is ms
        assert [id(zero.working_to_master_param[id(w)]) for w in ws] == list(map(id, ms))
    assert set(map(id, zero.optim.state)) <= masters
    lists = [*zero._working_param_groups.values(), *zero.pg_to_param_list.values()]
    return [[named[id(p)] for p in ps] for ps in lists]


def _check(  # type: ignore[no-untyped-def]
    rank: int, world_size: int, device: torch.device, folder: str, run=("bf16", 1)
) -> None:
    """``run``: (precision, zero_stage) of both boosters."""
    from colossal_hetero.moe.replace import expert_state

    generator = torch.Generator().manual_seed(3)
    batches = [
        torch.randint(0, 256, (world_size * PER_RANK, SEQ), generator=generator) for _ in range(4)
    ]
    moving, moves = _build(world_size, 2, run=run), list[tuple[dict, dict]]()
    _watch(moving, moves)
    _train(moving, batches[:2], rank)
    assert len(moves) == 1, len(moves)  # after step 1
    before, after = moves[0]
    _assert_same(after, before, "the move")
    assert sum(".experts." in name for name in after) == LAYERS * EXPERTS * 3
    for name, entry in after.items():
        assert torch.equal(entry["value"], entry["master"].to(entry["value"].dtype)), name
        assert sorted(entry["state"]) == ["exp_avg", "exp_avg_sq", "step"], name
    placements = [b.placement for b in moving[4]]
    assert placements[0].device_of != (0, 0, 1, 1), placements
    assert all(p == placements[0] for p in placements), "the reference needs one placement"
    order = _check_bookkeeping(moving)
    zero = moving[3]
    for p in (p for block in moving[4] for p in block.expert_parameters()):
        assert zero._padding_map[id(p)] == -p.numel() % (world_size // 2)  # moe_dp size
    with pytest.raises(ValueError, match="parallel.zero_stage"):  # slices: not whole
        expert_state(moving[4], moving[3])
    moving[1].save_model(moving[2], str(Path(folder) / "model"), shard=True)
    moving[1].save_optimizer(moving[3], str(Path(folder) / "optimizer"), shard=True)
    losses = _train(moving, batches[2:], rank)
    final = _snapshot(moving)

    groups = [list(placements[0].experts_on(d)) for d in range(2)]
    reference = _build(world_size, 0, groups, run)
    assert [b.placement for b in reference[4]] == placements
    reference[1].load_model(reference[2], str(Path(folder) / "model"))
    reference[1].load_optimizer(reference[3], str(Path(folder) / "optimizer"))
    _assert_same(_snapshot(reference), after, "loaded at the new placement")
    assert _check_bookkeeping(reference) == order
    assert _train(reference, batches[2:], rank) == losses, losses
    _assert_same(_snapshot(reference), final, "two steps on from the move")
    for run in (moving, reference):
        run[0].close()


@pytest.mark.timeout(300)
def test_replacement_under_zero1_moves_master_slices_exactly(tmp_path: Path) -> None:
    run_distributed(_check, 4, force_cpu=True, folder=str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_replacement_under_zero2_fp16(tmp_path: Path) -> None:
    """fp16 with ``zero_stage: 2`` (which Colossal-AI's MoE plugin runs as ZeRO-1; its loss
    scaler is one value for the world, untouched by a move): the same checks."""
    run_distributed(_check, 4, force_cpu=True, folder=str(tmp_path), run=("fp16", 2))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_replacement_under_zero1_padded_slices(tmp_path: Path) -> None:
    """EP=2 x DP=3 on 6 ranks: each expert tensor's 512 elements split over a ZeRO group of 3
    with 1 element of padding, so a moved expert's padded working buffer is rebuilt on the new
    holder; the same checks."""
    run_distributed(_check, 6, force_cpu=True, folder=str(tmp_path))


def _check_resume(rank: int, world_size: int, device: torch.device, folder: str) -> None:
    """test_moe_resume's check (the trainer resumes a re-placing run exactly: losses, learning
    rates and later decisions bit for bit) with both runs under bf16 ZeRO-1: the restore moves
    the experts back to the saved placement through moe/replace_zero.py."""
    from tests.distributed import test_moe_resume as resume

    plain = resume._config

    def zero_config(folder: Path, name: str, resume: bool) -> dict:
        return {**plain(folder, name, resume), "parallel": ZERO_PARALLEL}

    resume._config = zero_config  # this spawned process only
    resume._check(rank, world_size, device, folder)


ZERO_PARALLEL = {"ep": 2, "zero_stage": 1, "precision": "bf16"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_resumes_a_zero_run_with_replacement_exactly(tmp_path: Path) -> None:
    run_distributed(_check_resume, 4, force_cpu=True, folder=str(tmp_path))
