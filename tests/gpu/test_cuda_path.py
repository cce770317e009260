"""The CUDA path on one GPU (skipped where torch sees no GPU: CI and the 2-core host).

Several ranks need a GPU each (NCCL refuses two ranks on one device), so a single-GPU
machine checks what one rank exercises: the trainer on CUDA with NCCL (device resolution,
the plugin's CUDA settings, bf16), exact resume, the first loss against the CPU path from
the same weights and batch, the device module's CUDA branch, and the ZERO-resizing kernels
(index gathers, scatters and the smaller GEMMs) against a float64 reference on the CPU.

Run: ``python -m pytest tests/gpu -q`` on a machine with a GPU.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from colossal_hetero.cli import launch_command
from colossal_hetero.metrics import read_run
from colossal_hetero.utils import device as devices
from tests.tolerances import sum_order_atol
from tests.train_configs import FORWARD_RTOL
from tests.train_configs import TINY_GPT2 as E2E_GPT2
from tests.train_configs import with_sections as _with

pytestmark = pytest.mark.skipif(
    devices.cuda_device_count() == 0, reason="needs a CUDA GPU (torch sees none)"
)

# The first loss on CUDA and on CPU: the same weights and batch, the forward chain in float32
# summed in other orders (FORWARD_RTOL). TF32 would break it (10 mantissa bits), so it also
# checks that nothing turns TF32 on behind the user's back.
TINY_GPT2 = {
    **_with(
        E2E_GPT2,
        model={"arch": "gpt2", "hf": {**E2E_GPT2["model"]["hf"], "n_embd": 64}},
        cluster={"device": "cuda"},
    ),
    "parallel": {"tp": 1, "pp": 1},  # one rank: NCCL wants a GPU per rank
}


def _train(config: dict, folder: Path, *, hide_gpu: bool = False) -> list:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if hide_gpu:
        env.update(devices.no_accelerator_env())
    result = subprocess.run(
        launch_command(path, 1), capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return read_run(Path(config["logging"]["dir"]))


def test_gpt2_on_cuda_matches_cpu_trains_and_resumes_exactly(tmp_path):
    checkpoints = tmp_path / "ckpt"
    full = _with(
        TINY_GPT2,
        logging={"dir": str(tmp_path / "full")},
        checkpoint={"dir": str(checkpoints), "every": 4},
    )
    records = _train(full, tmp_path / "full")
    val = [r.val_loss for r in records if r.val_loss is not None]
    assert len(val) == 2 and val[1] < val[0] - 0.1, f"validation loss did not fall: {val}"

    cpu = _with(
        TINY_GPT2,
        cluster={"device": "cpu"},
        train={"steps": 1, "eval_every": 0},
        logging={"dir": str(tmp_path / "cpu")},
    )
    first_cpu = _train(cpu, tmp_path / "cpu", hide_gpu=True)[0]
    first_cuda = next(r for r in records if r.step == 0)
    assert abs(first_cuda.loss - first_cpu.loss) <= FORWARD_RTOL * first_cpu.loss, (
        first_cuda.loss,
        first_cpu.loss,
    )

    # Continue from the step-4 checkpoint: same weights, moments, rate and data position.
    (checkpoints / "step_8" / "trainer.json").unlink()
    resumed = _with(
        full,
        logging={"dir": str(tmp_path / "resumed")},
        checkpoint={"dir": str(checkpoints), "every": 0, "resume": True},
    )
    again = {r.step: r for r in _train(resumed, tmp_path / "resumed")}
    assert min(again) == 4
    for record in records:
        if record.step >= 4:
            # Bitwise on one device: CUDA's GEMMs are deterministic for the same shapes.
            assert again[record.step].loss == record.loss, record.step


def test_bf16_on_cuda_trains(tmp_path):
    config = _with(
        TINY_GPT2,
        parallel={"tp": 1, "pp": 1, "precision": "bf16"},
        logging={"dir": str(tmp_path / "bf16")},
    )
    records = _train(config, tmp_path / "bf16")
    val = [r.val_loss for r in records if r.val_loss is not None]
    assert len(val) == 2 and val[1] < val[0] - 0.1, f"validation loss did not fall: {val}"


def test_device_module_cuda_branch():
    gpu = devices.resolve_device("auto", 0, 1)
    assert gpu == torch.device("cuda", 0)
    assert devices.resolve_device("cpu", 0, 1).type == "cpu"
    with pytest.raises(ValueError, match="cluster.device: 'cuda' needs"):
        devices.resolve_device("cuda", 0, devices.cuda_device_count() + 1)
    assert devices.backend_for(gpu) == "nccl" and devices.has_side_streams(gpu)
    assert devices.device_kind(gpu) == "cuda"
    devices.bind_device(gpu)
    free = devices.available_memory_bytes(gpu)
    block = torch.empty(64 << 20, dtype=torch.uint8, device=gpu)
    devices.synchronize(gpu)
    assert devices.max_memory_allocated(gpu) >= block.numel()
    assert 0 < devices.available_memory_bytes(gpu) <= free


def _abs_scale(a: torch.Tensor, b: torch.Tensor) -> float:
    """max over the result of sum |a_ik b_kj|: the scale of one GEMM's rounding."""
    return float((a.abs() @ b.abs()).max())


# float32 and float64 only: a worst-case bound for bfloat16 sums of 256 terms exceeds the
# values themselves (256 u > 1), so it could not fail; bf16 is covered by training above.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_resized_linear_kernels_on_cuda(dtype):
    from colossal_hetero.balance.ops import resized_linear
    from colossal_hetero.balance.ops.resize import mean_imputed_linear

    gpu = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(5)
    rows, k, n = 96, 256, 48
    x, w, b, dy = (
        torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
        for shape in ((rows, k), (n, k), (n,), (rows, n))
    )
    order = torch.randperm(k, generator=gen)
    kept, dropped = order[: k * 5 // 8].sort().values, order[k * 5 // 8 :].sort().values
    # The reference computes in float64 from the same (already rounded) inputs, so the only
    # differences are the GPU's sums in another order (Higham's bound, scaled by the sum of
    # the terms' magnitudes) and the final rounding of each result.
    u = torch.finfo(dtype).eps / 2
    xd, wd, bd, dyd = x.double(), w.double(), b.double(), dy.double()

    def close(got: torch.Tensor, ref: torch.Tensor, terms: int, scale: float) -> None:
        atol = sum_order_atol(terms, dtype, scale) + u * float(ref.abs().max())
        torch.testing.assert_close(got.double().cpu(), ref, rtol=0, atol=atol)

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.to(gpu).requires_grad_()

    xs, ws, bs = leaf(x), leaf(w), leaf(b)
    y = resized_linear(xs, ws, bs, kept.to(gpu), 0.0)
    (y * dy.to(gpu)).sum().backward()
    xk, wk = xd[:, kept], wd[:, kept]
    close(y, xk @ wk.t() + bd, len(kept) + 1, _abs_scale(xk, wk.t()) + float(bd.abs().max()))
    close(xs.grad[:, kept], dyd @ wk, n, _abs_scale(dyd, wk))
    close(ws.grad[:, kept], dyd.t() @ xk, rows, _abs_scale(dyd.t(), xk))
    assert bool((xs.grad[:, dropped] == 0).all()) and bool((ws.grad[:, dropped] == 0).all())

    # Mean imputation: the dropped columns see the batch mean of their inputs.
    ym = mean_imputed_linear(leaf(x), leaf(w), None, kept.to(gpu), dropped.to(gpu))
    mean, wdrop = xd[:, dropped].mean(0, keepdim=True), wd[:, dropped]
    scale = _abs_scale(xk, wk.t()) + _abs_scale(
        xd[:, dropped].abs().mean(0, keepdim=True), wdrop.t()
    )
    close(ym, xk @ wk.t() + mean @ wdrop.t(), k + rows, scale)
