"""Checkpoints of an expert-parallel run through the plugin (checkpoint/moe.py), on gloo ranks.

A plain Booster loop, EP=2 x DP=2 on 4 ranks, fp32, AdamW, the tiny Mixtral of
test_moe_plugin (4 experts, top-2, router aux loss on). One spawn (and one slow one, ZeRO):

- ``a`` trains 2 steps, saves model and optimizer (sharded folders) and trains 2 more: the
  uninterrupted run.
- ``b``, a fresh booster whose model starts from other weights, loads the checkpoint: every
  weight and AdamW state (moments and step), collected by name from wherever it lives, equals
  ``a``'s at the save bit for bit; its next two steps' losses, and then every weight and
  state, equal ``a``'s bit for bit (same placement, same arithmetic).
- ``c`` places the experts differently (``moe.placement`` [[0, 2], [1, 3]] against the even
  [[0, 1], [2, 3]]) and loads the one-file checkpoint (``shard=False``) of the same state: the
  loaded state equals ``a``'s at the save bit for bit (names, not positions); the next step's
  loss is within the fp32 chain tolerance of ``a``'s (only where the experts run changes; Adam
  is compared one step from equal state, see tests/tolerances.py).
- the model folder loads into a single-process Hugging Face ``MixtralForCausalLM``
  (``from_pretrained``, EP=1, the independent reference): its loss on each rank's next batch
  equals ``a``'s loss there within the fp32 chain tolerance of the forward.
- loading an optimizer checkpoint missing a parameter's state is one ValueError (every rank).
- slow: bf16 under ZeRO-1 (Colossal-AI's MoE optimizer) and at zero_stage 0 (AMP wrapper,
  our reducers): the same round trip, bit-exact, fp32 masters included; and a zero_stage 0
  checkpoint loads into a ZeRO booster (see ``_check_zero``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed.test_moe_plugin import K_MAX, LAYERS, PER_RANK, SEQ, _model
from tests.tolerances import chain_atol, transformer_depth

STEPS_BEFORE, STEPS_AFTER = 2, 2


def _build(  # type: ignore[no-untyped-def]
    placement: list | None = None, seed: int = 0, zero: int = 0, precision: str = "fp32"
):
    from colossal_hetero.config.moe import MoeConfig
    from colossal_hetero.config.parallel import ParallelConfig
    from colossal_hetero.config.schema import HeteroConfig, PlanConfig
    from colossal_hetero.moe.block import HeteroEPMixtralSparseMoeBlock
    from colossal_hetero.plugin import HeteroParallelPlugin

    parallel = ParallelConfig(ep=2, zero_stage=1 if zero else 0, precision=precision)  # type: ignore[arg-type]
    config = HeteroConfig(
        parallel=parallel,
        moe=MoeConfig(chunk_kib=1, placement=placement or []),
        plan=PlanConfig(mode="even"),
    )
    plugin = HeteroParallelPlugin(config)
    booster, model, optimizer = boost_perturbed(plugin, _model(), seed)
    blocks = [m for m in model.modules() if isinstance(m, HeteroEPMixtralSparseMoeBlock)]
    return plugin, booster, model, optimizer, blocks


def boost_perturbed(plugin, model, seed: int):  # type: ignore[no-untyped-def]
    """(booster, model, optimizer): ``model`` with AdamW at lr 1e-2 boosted by ``plugin``; with
    a ``seed``, other starting weights first (noise added), so that a load missing a tensor
    shows."""
    from colossalai.booster import Booster

    if seed:
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return booster, model, optimizer


def _batches(world_size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    steps = STEPS_BEFORE + STEPS_AFTER
    return [
        torch.randint(0, 256, (world_size * PER_RANK, SEQ), generator=generator)
        for _ in range(steps)
    ]


def _train(run, batches: list[torch.Tensor], rank: int) -> list[float]:  # type: ignore[no-untyped-def]
    _, booster, model, optimizer, _ = run
    losses = []
    for batch in batches:
        ids = batch.split(PER_RANK)[rank]
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def _state(run) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Every weight and AdamW state by placement-free name (collective over the ep group)."""
    from colossal_hetero.moe.replace import expert_state

    _, _, model, optimizer, blocks = run
    out: dict[str, torch.Tensor] = {}
    for key, entry in expert_state(blocks, optimizer).items():
        out[key] = entry["value"]
        out.update({f"{key}/{k}": v for k, v in entry["optim"].items()})
    for name, p in model.unwrap().named_parameters():
        if ".experts." not in name:
            out[name] = p.detach().clone()
            state = optimizer.optim.state.get(p, {})
            out.update({f"{name}/{k}": v.clone() for k, v in state.items()})
    return out


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{what}: {key}"


def _check(rank: int, world_size: int, device: torch.device, folder: str) -> None:
    batches = _batches(world_size)
    model_dir, optim_dir = Path(folder) / "model", Path(folder) / "optimizer"
    a = _build()
    _train(a, batches[:STEPS_BEFORE], rank)
    a[1].save_model(a[2], str(model_dir), shard=True)
    a[1].save_optimizer(a[3], str(optim_dir), shard=True)
    one_file = Path(folder) / "model.bin", Path(folder) / "optimizer.bin"  # shard=False
    a[1].save_model(a[2], str(one_file[0]))
    a[1].save_optimizer(a[3], str(one_file[1]))
    saved = _state(a)
    after_a = _train(a, batches[STEPS_BEFORE:], rank)
    final_a = _state(a)

    b = _build(seed=7)
    b[1].load_model(b[2], str(model_dir))
    b[1].load_optimizer(b[3], str(optim_dir))
    _assert_equal(_state(b), saved, "loaded, same placement")
    assert _train(b, batches[STEPS_BEFORE:], rank) == after_a
    _assert_equal(_state(b), final_a, "trained on, same placement")

    c = _build(placement=[[0, 2], [1, 3]], seed=11)
    assert c[4][0].held != a[4][0].held
    c[1].load_model(c[2], str(one_file[0]))
    c[1].load_optimizer(c[3], str(one_file[1]))
    _assert_equal(_state(c), saved, "loaded, other placement")
    forward = chain_atol(transformer_depth(LAYERS, backward=False) + 4, K_MAX, torch.float32, 10.0)
    (loss_c,) = _train(c, batches[STEPS_BEFORE : STEPS_BEFORE + 1], rank)
    assert abs(loss_c - after_a[0]) <= forward, (loss_c, after_a[0])

    _check_hf(model_dir, batches[STEPS_BEFORE], rank, after_a[0], forward)
    _check_missing_state(c, optim_dir, Path(folder), rank)
    for run in (a, b, c):
        run[0].close()


def _check_zero(rank: int, world_size: int, device: torch.device, folder: str) -> None:
    """bf16 on both optimizer paths: ZeRO-1 (Colossal-AI's MoE optimizer, flat padded shards)
    and zero_stage 0 (our reducers, Colossal-AI's AMP wrapper). Each saves after 2 steps and
    trains 2 more; a fresh booster loads: its two losses are bit-equal, and so is what both
    save at the end (every state and fp32 master). Then the zero_stage 0 checkpoint loads into
    a ZeRO booster: the same file on both paths, so its first loss (the same bf16 weights) is
    bit-equal too."""
    batches, root = _batches(world_size), Path(folder)
    firsts = []
    for zero in (1, 0):
        folder_ = root / f"zero{zero}"
        d = _build(zero=zero, precision="bf16")
        _train(d, batches[:STEPS_BEFORE], rank)
        d[1].save_model(d[2], str(folder_ / "model"), shard=True)
        d[1].save_optimizer(d[3], str(folder_ / "optimizer"), shard=True)
        after_d = _train(d, batches[STEPS_BEFORE:], rank)
        e = _build(zero=zero, precision="bf16", seed=7)
        e[1].load_model(e[2], str(folder_ / "model"))
        e[1].load_optimizer(e[3], str(folder_ / "optimizer"))
        assert _train(e, batches[STEPS_BEFORE:], rank) == after_d, zero
        for run, name in ((d, "end_d"), (e, "end_e")):
            run[1].save_optimizer(run[3], str(folder_ / name), shard=True)
            run[0].close()
        if rank == 0:
            _compare_saved(folder_ / "end_d", folder_ / "end_e")
        firsts.append(after_d[0])
    h = _build(zero=1, precision="bf16", seed=3)
    h[1].load_model(h[2], str(root / "zero0" / "model"))
    h[1].load_optimizer(h[3], str(root / "zero0" / "optimizer"))
    assert _train(h, batches[STEPS_BEFORE : STEPS_BEFORE + 1], rank)[0] == firsts[1]
    h[0].close()


def _compare_saved(one: Path, two: Path) -> None:
    from colossal_hetero.checkpoint.moe import OPTIMIZER_FILE

    ends = [torch.load(f / OPTIMIZER_FILE, weights_only=False) for f in (one, two)]
    assert ends[0]["masters"] and sorted(ends[0]["states"]) == sorted(ends[1]["states"])
    assert sorted(ends[0]["masters"]) == sorted(ends[1]["masters"])
    for name, state in ends[0]["states"].items():
        for key, value in state.items():
            assert torch.equal(ends[1]["states"][name][key], value), (one, name, key)
    for name, master in ends[0]["masters"].items():
        assert master.dtype == torch.float32 and torch.equal(ends[1]["masters"][name], master)


def _check_hf(model_dir: Path, batch: torch.Tensor, rank: int, loss: float, tol: float) -> None:
    from transformers import MixtralForCausalLM

    hf = MixtralForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = batch.split(PER_RANK)[rank]
    with torch.no_grad():
        hf_loss = float(hf(input_ids=ids, labels=ids).loss)
    assert abs(hf_loss - loss) <= tol, (hf_loss, loss)


def _check_missing_state(run, optim_dir: Path, folder: Path, rank: int) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    from colossal_hetero.checkpoint.moe import OPTIMIZER_FILE

    broken = folder / "broken.pt"
    if rank == 0:
        saved = torch.load(optim_dir / OPTIMIZER_FILE, weights_only=False)
        saved["states"].pop(next(k for k in saved["states"] if ".experts.1." in k))
        torch.save(saved, broken)
    dist.barrier()
    with pytest.raises(ValueError, match="no optimizer state for"):
        run[1].load_optimizer(run[3], str(broken))


@pytest.mark.timeout(300)
def test_ep_checkpoint_round_trips_across_placements(tmp_path: Path) -> None:
    run_distributed(_check, 4, force_cpu=True, folder=str(tmp_path))


@pytest.mark.slow  # a second spawn of 4 ranks: over the default suite's 20 s
@pytest.mark.timeout(600)
def test_ep_checkpoint_round_trips_in_bf16_with_and_without_zero(tmp_path: Path) -> None:
    run_distributed(_check_zero, 4, force_cpu=True, folder=str(tmp_path))
