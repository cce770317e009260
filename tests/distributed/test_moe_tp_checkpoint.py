"""Checkpoints of expert parallelism with tensor parallelism around it (checkpoint/moe.py), on 4
gloo ranks: EP=2 x TP=2 (dp 2, moe_dp 1) and EP=2 x TP=1 (dp 4, moe_dp 2), one spawn.

The tiny Mixtral of test_moe_plugin (4 experts, top-2, router aux loss) in fp32 with AdamW, a
plain Booster loop; rank ``r`` trains on data-parallel shard ``r // 2`` in both layouts. The
test's own view of a run (``_everything``) is independent of the checkpoint code: every weight,
AdamW state (moments, step) and fp32 master by HF name, tp shards all-gathered along the one
dim where they are shorter than the single-process model's tensor, merged over all ranks
(replicas must agree bit for bit).

- ``a`` (EP=2 x TP=2) trains 2 steps, saves model and optimizer (sharded folders), trains 2
  more: the uninterrupted run.
- the files: the model folder's tensors (``MixtralForCausalLM.from_pretrained``, a single
  process, EP=1 and TP=1) and the optimizer file's states equal ``a``'s at the save bit for bit;
  the HF model's loss on each rank's next batch equals ``a``'s there within the fp32 chain
  tolerance of the forward.
- ``c`` (EP=2 x TP=1, other starting weights) loads them: everything equals ``a``'s at the save
  bit for bit; it saves again (one-file, ``shard=False``) and trains a step, whose loss is
  within the forward tolerance of ``a``'s (other reduction widths).
- ``b`` (EP=2 x TP=2, other starting weights) loads ``a``'s folders: everything equals ``a``'s
  at the save bit for bit, its next two losses and then everything equal ``a``'s bit for bit
  (same layout, same arithmetic); then it loads ``c``'s re-save (TP=1 back to TP=2): again
  everything equals ``a``'s at the save.
Slow: the same on 8 ranks (moe_dp 2, then dp 8) and with vocabulary 250 (Colossal-AI pads
the embedding to 256 rows before splitting it), the round trip in bf16 (fp32 masters of each
tp shard), and the trainer's ``checkpoint.dir`` resume on EP=2 x TP=2 (losses and learning
rates bit for bit).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.distributed.test_moe_checkpoint import boost_perturbed
from tests.distributed.test_moe_plugin import K_MAX, LAYERS, PER_RANK, SEQ
from tests.distributed.test_moe_plugin import _model as _model_256
from tests.tolerances import chain_atol, transformer_depth

STEPS_BEFORE, STEPS_AFTER, TP = 2, 2, 2


def _model(vocab: int = 256):  # type: ignore[no-untyped-def]
    """test_moe_plugin's tiny Mixtral, with another vocabulary size if asked (same seed)."""
    from transformers import MixtralForCausalLM

    model = _model_256()
    if vocab == 256:
        return model
    model.config.vocab_size = vocab
    torch.manual_seed(0)
    return MixtralForCausalLM(model.config)


def _build(tp: int, seed: int = 0, precision: str = "fp32", vocab: int = 256):  # type: ignore[no-untyped-def]
    from colossal_hetero.config.moe import MoeConfig
    from colossal_hetero.config.parallel import ParallelConfig
    from colossal_hetero.config.schema import HeteroConfig
    from colossal_hetero.plugin import HeteroParallelPlugin

    parallel = ParallelConfig(ep=2, tp=tp, precision=precision)  # type: ignore[arg-type]
    config = HeteroConfig(parallel=parallel, moe=MoeConfig(chunk_kib=1))
    plugin = HeteroParallelPlugin(config)
    booster, model, optimizer = boost_perturbed(plugin, _model(vocab), seed)
    return plugin, booster, model, optimizer


def _batches(world_size: int, vocab: int = 256) -> list[torch.Tensor]:
    """One batch per step: a shard of ``PER_RANK`` rows per EP x TP data-parallel rank."""
    generator = torch.Generator().manual_seed(5)
    return [
        torch.randint(0, vocab, (world_size // TP * PER_RANK, SEQ), generator=generator)
        for _ in range(STEPS_BEFORE + STEPS_AFTER)
    ]


def _train(run, batches: list[torch.Tensor], rank: int) -> list[float]:  # type: ignore[no-untyped-def]
    _, booster, model, optimizer = run
    losses = []
    for batch in batches:
        ids = batch.split(PER_RANK)[rank // TP]
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def _full(local: torch.Tensor, shape: torch.Size, group: Any) -> torch.Tensor:
    """``local`` all-gathered over the tp ``group`` along the one dim where it differs from
    ``shape`` (as it is when it has the full shape); a padded vocabulary cut to ``shape``."""
    dims = [d for d in range(local.dim()) if local.shape[d] != shape[d]]
    if not dims:
        return local.detach().clone()
    assert len(dims) == 1, (local.shape, shape)
    size, dim = dist.get_world_size(group), dims[0]
    assert 0 <= local.shape[dim] * size - shape[dim] < 64 * size, (local.shape, shape)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim).narrow(dim, 0, shape[dim])


def _everything(run, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Every weight (``name``), optimizer state (``name/key``) and master (``name/master``) of
    the run, full-shaped, merged over all ranks (collective; tp peers hold the same names)."""
    plugin, _, model, optimizer = run
    group = plugin.engine.tp_group
    module = model.unwrap()
    names = {id(p): n for n, p in module.named_parameters()}
    mine = {n: _full(p, shapes[n], group) for n, p in module.named_parameters()}
    to_working = optimizer.get_master_to_working_map() or {}
    for param in (p for g in optimizer.param_groups for p in g["params"]):
        working = to_working.get(id(param), param)
        name = names[id(working)]
        for key, value in optimizer.optim.state.get(param, {}).items():
            per_element = value.dim() > 0
            mine[f"{name}/{key}"] = _full(value, shapes[name], group) if per_element else value
        if param is not working:
            mine[f"{name}/master"] = _full(param, shapes[name], group)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in everyone:
        for key, value in part.items():
            assert key not in merged or torch.equal(merged[key], value), key  # replicas agree
            merged[key] = value
    return merged


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{what}: {key}"


def _check(  # type: ignore[no-untyped-def]
    rank: int, world_size: int, device: torch.device, folder: str, vocab: int = 256
) -> None:
    batches, root = _batches(world_size, vocab), Path(folder)
    shapes = {n: p.shape for n, p in _model(vocab).named_parameters()}
    a = _build(TP, vocab=vocab)
    if vocab % (64 * TP):  # the padded path is the one under test
        from colossalai.tensor.padded_tensor import is_padded_tensor

        assert is_padded_tensor(a[2].unwrap().model.embed_tokens.weight)
    _train(a, batches[:STEPS_BEFORE], rank)
    a[1].save_model(a[2], str(root / "model"), shard=True)
    a[1].save_optimizer(a[3], str(root / "optimizer"), shard=True)
    saved = _everything(a, shapes)
    after_a = _train(a, batches[STEPS_BEFORE:], rank)
    final_a = _everything(a, shapes)
    forward = chain_atol(transformer_depth(LAYERS, backward=False) + 4, K_MAX, torch.float32, 10.0)
    _check_files(root, saved, batches[STEPS_BEFORE], rank, after_a[0], forward)

    c = _build(1, seed=11, vocab=vocab)  # EP=2 x TP=1: dp 4, moe_dp 2
    c[1].load_model(c[2], str(root / "model"))
    c[1].load_optimizer(c[3], str(root / "optimizer"))
    _assert_equal(_everything(c, shapes), saved, "TP=2 -> TP=1")
    c[1].save_model(c[2], str(root / "model_tp1.bin"))
    c[1].save_optimizer(c[3], str(root / "optimizer_tp1.bin"))
    (loss_c,) = _train(c, batches[STEPS_BEFORE : STEPS_BEFORE + 1], rank)
    assert abs(loss_c - after_a[0]) <= forward, (loss_c, after_a[0])

    b = _build(TP, seed=7, vocab=vocab)
    b[1].load_model(b[2], str(root / "model"))
    b[1].load_optimizer(b[3], str(root / "optimizer"))
    _assert_equal(_everything(b, shapes), saved, "TP=2 -> TP=2")
    assert _train(b, batches[STEPS_BEFORE:], rank) == after_a
    _assert_equal(_everything(b, shapes), final_a, "TP=2 -> TP=2, trained on")
    b[1].load_model(b[2], str(root / "model_tp1.bin"))
    b[1].load_optimizer(b[3], str(root / "optimizer_tp1.bin"))
    _assert_equal(_everything(b, shapes), saved, "TP=2 -> TP=1 -> TP=2")
    for run in (a, c, b):
        run[0].close()


def _check_files(  # type: ignore[no-untyped-def]
    root: Path, saved: dict, batch: torch.Tensor, rank: int, loss: float, tol: float
) -> None:
    """The model folder in a single-process HF Mixtral and the optimizer file hold ``saved``
    bit for bit; the HF model's loss on this rank's shard is ``loss`` within ``tol``."""
    from transformers import MixtralForCausalLM

    from colossal_hetero.checkpoint.moe import OPTIMIZER_FILE

    hf = MixtralForCausalLM.from_pretrained(root / "model", torch_dtype=torch.float32).eval()
    weights = {n: t for n, t in saved.items() if "/" not in n}
    _assert_equal(dict(hf.named_parameters()), weights, "model folder")
    states = torch.load(root / "optimizer" / OPTIMIZER_FILE, weights_only=False)["states"]
    flat = {f"{n}/{k}": v for n, state in states.items() for k, v in state.items()}
    _assert_equal(flat, {n: t for n, t in saved.items() if "/" in n}, "optimizer file")
    ids = batch.split(PER_RANK)[rank // TP]
    with torch.no_grad():
        hf_loss = float(hf(input_ids=ids, labels=ids).loss)
    assert abs(hf_loss - loss) <= tol, (hf_loss, loss)


def _check_bf16(rank: int, world_size: int, device: torch.device, folder: str) -> None:
    """bf16 (Colossal-AI's AMP wrapper keeps fp32 masters of each tp shard): a saves after 2
    steps and trains 2 more; b (other weights) loads: everything, fp32 masters included, equals
    a's at the save, then b's two losses and everything equal a's bit for bit; the optimizer
    file holds every master as a full fp32 tensor."""
    from colossal_hetero.checkpoint.moe import OPTIMIZER_FILE

    batches, root = _batches(world_size), Path(folder)
    shapes = {n: p.shape for n, p in _model().named_parameters()}
    a = _build(TP, precision="bf16")
    _train(a, batches[:STEPS_BEFORE], rank)
    a[1].save_model(a[2], str(root / "model"), shard=True)
    a[1].save_optimizer(a[3], str(root / "optimizer"), shard=True)
    saved = _everything(a, shapes)
    assert sum(key.endswith("/master") for key in saved) == len(shapes)
    after_a = _train(a, batches[STEPS_BEFORE:], rank)
    final_a = _everything(a, shapes)
    masters = torch.load(root / "optimizer" / OPTIMIZER_FILE, weights_only=False)["masters"]
    _assert_equal({f"{n}/master": m for n, m in masters.items()}, _masters(saved), "masters")
    b = _build(TP, seed=7, precision="bf16")
    b[1].load_model(b[2], str(root / "model"))
    b[1].load_optimizer(b[3], str(root / "optimizer"))
    _assert_equal(_everything(b, shapes), saved, "bf16, loaded")
    assert _train(b, batches[STEPS_BEFORE:], rank) == after_a
    _assert_equal(_everything(b, shapes), final_a, "bf16, trained on")
    for run in (a, b):
        run[0].close()


def _masters(saved: dict) -> dict:
    found = {n: t for n, t in saved.items() if n.endswith("/master")}
    assert all(t.dtype == torch.float32 for t in found.values())
    return found


@pytest.mark.timeout(300)
def test_ep2_tp2_checkpoint_round_trips_through_tp1_and_hf(tmp_path: Path) -> None:
    run_distributed(_check, 4, force_cpu=True, folder=str(tmp_path))


@pytest.mark.slow  # 8 ranks on the CI's cores
@pytest.mark.timeout(900)
def test_ep2_tp2_dp4_checkpoint_round_trips_through_tp1(tmp_path: Path) -> None:
    """The same on 8 ranks: EP=2 x TP=2 with moe_dp 2 (only moe_dp rank 0 gathers and sends),
    through EP=2 x TP=1 (dp 8, moe_dp 4)."""
    run_distributed(_check, 8, force_cpu=True, folder=str(tmp_path))


@pytest.mark.slow  # a second spawn of 4 ranks
@pytest.mark.timeout(600)
def test_ep2_tp2_checkpoint_with_a_padded_vocabulary(tmp_path: Path) -> None:
    """Vocabulary 250: Colossal-AI pads the embedding and LM head to 256 rows (a multiple of 64
    x tp) before splitting them; the files hold the 250 HF rows, loading pads again."""
    run_distributed(_check, 4, force_cpu=True, folder=str(tmp_path), vocab=250)


@pytest.mark.slow  # a second spawn of 4 ranks
@pytest.mark.timeout(600)
def test_ep2_tp2_checkpoint_round_trips_in_bf16_with_masters(tmp_path: Path) -> None:
    run_distributed(_check_bf16, 4, force_cpu=True, folder=str(tmp_path))


def _trainer_config(root: Path, name: str, resume: bool) -> dict:
    from tests.unit.test_moe_config import HF

    return {
        "model": {"arch": "mixtral", "hf": {**HF, "router_aux_loss_coef": 0.02}},
        "data": {"dataset": "pydoc_topics", "seq_len": 16, "global_batch_size": 8},
        "parallel": {"ep": 2, "tp": TP},
        "moe": {"chunk_kib": 1},
        "optimizer": {"name": "adamw", "lr": 0.01},
        "train": {"steps": 4, "eval_every": 0},
        "logging": {"dir": str(root / name), "progress": False, "plot": False},
        "checkpoint": {"dir": str(root / "ckpt"), "every": 0 if resume else 2, "resume": resume},
    }


def _check_trainer(rank: int, world_size: int, device: torch.device, folder: str) -> None:
    """The trainer with ``checkpoint.dir`` on EP=2 x TP=2 (validated, no longer refused): a
    run of 4 steps checkpoints at step 2; a fresh run resumes there (the step-4 checkpoint
    hidden) and its steps 3 and 4 have the uninterrupted run's losses and learning rates bit
    for bit (every rank)."""
    from colossal_hetero.config.loader import from_dict
    from colossal_hetero.config.schema import RunConfig
    from colossal_hetero.metrics import read_run
    from colossal_hetero.training.trainer import run_training

    root = Path(folder)
    run_training(from_dict(RunConfig, _trainer_config(root, "full", False)), device)
    if rank == 0:
        (root / "ckpt" / "step_4" / "trainer.json").unlink()
    dist.barrier()
    run_training(from_dict(RunConfig, _trainer_config(root, "resumed", True)), device)
    dist.barrier()
    records = {(r.step, r.rank): r for r in read_run(root / "full")}
    twins = {(r.step, r.rank): r for r in read_run(root / "resumed")}
    assert sorted({step for step, _ in twins}) == [2, 3], sorted(twins)
    for key, twin in twins.items():
        assert (twin.loss, twin.lr) == (records[key].loss, records[key].lr), key


@pytest.mark.slow  # the trainer twice on 4 ranks
@pytest.mark.timeout(600)
def test_trainer_resumes_an_ep2_tp2_run_exactly(tmp_path: Path) -> None:
    run_distributed(_check_trainer, 4, force_cpu=True, folder=str(tmp_path))
