"""Each CPU fix: the stock behaviour fails (checked in a clean subprocess), the fixed one works.

The "fixed" half of every check fails if its fix is removed from cpu_support.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
import torch.distributed as dist

from colossal_hetero.utils.teardown import close_process_group

# Each probe prints OK or the exception type name; run once stock and once with the fixes.
PROBES = textwrap.dedent(
    """
    import os, sys, tempfile, time, torch, torch.distributed as dist
    if sys.argv[1] == "fixed":
        from colossal_hetero.compat.cpu_support import apply_cpu_support
        apply_cpu_support()
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator
    from colossalai.pipeline import p2p
    from colossalai.shardformer.layer.utils import Randomizer
    from colossalai.shardformer.modeling import gpt2 as gpt2_modeling
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    acc = CpuAccelerator()

    def probe(name, fn):
        try:
            fn()
            print("probe", name, "OK")
        except BaseException as error:
            print("probe", name, type(error).__name__)

    class FakeZero:
        optim = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        _dtype = torch.float32

    probe("rng_state", lambda: acc.set_rng_state(acc.get_rng_state()))
    probe("randomizer", lambda: Randomizer(seed=3))
    probe("stream", lambda: acc.current_stream().wait_stream(acc.Stream()))
    probe("synchronize", lambda: acc.synchronize())
    probe("p2p_backend", lambda: p2p._check_device(None))
    probe("zero_check", lambda: LowLevelZeroOptimizer._sanity_checks(FakeZero()))
    def zero_step_with_overlap():
        param = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
        zero = LowLevelZeroOptimizer(torch.optim.SGD([param], lr=0.1), overlap_communication=True)
        zero.backward((param.float() ** 2).sum())
        zero.step()

    probe("zero_overlap", zero_step_with_overlap)
    probe("modeling_set_device", lambda: gpt2_modeling.torch.cuda.set_device(torch.device("cpu")))
    # Leave without tearing the gloo group down: torch 2.5.1's destroy can deadlock with a
    # worker still releasing a finished op (pytorch PR 154976); this process is done anyway.
    sys.stdout.flush()
    time.sleep(0.2)
    os._exit(0)
    """
)


def _run_probes(mode: str) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as folder:
        result = subprocess.run(
            [sys.executable, "-c", PROBES, mode, os.path.join(folder, "init")],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
    assert result.returncode == 0, result.stderr[-3000:]
    # only the probes' lines: an optional package (DeepSpeed's accelerator notice) may print too
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith("probe ")]
    return {name: outcome for _, name, outcome in lines}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict[str, str]]:
    return {"stock": _run_probes("stock"), "fixed": _run_probes("fixed")}


@pytest.mark.parametrize(
    ("probe", "stock_error"),
    [
        ("rng_state", "TypeError"),  # torch.get_rng_state(device): takes no argument
        ("randomizer", "TypeError"),  # every shardformer TP layer builds one (issue #5211)
        ("stream", "RuntimeError"),  # ZeRO's bucket store and reduction stream
        ("synchronize", "RuntimeError"),  # ZeRO step and checkpoint IO
        ("p2p_backend", "AttributeError"),  # Backend.HCCL / is_hccl_available missing
        ("zero_check", "AssertionError"),  # asserts the accelerator is cuda or npu
        ("zero_overlap", "AssertionError"),  # then record_stream on a CPU tensor: RuntimeError
        ("modeling_set_device", "ValueError"),  # torch.cuda.set_device(cpu) in GPT-2 PP forward
    ],
)
def test_fix_is_needed_and_works(outcomes, probe, stock_error):
    assert outcomes["stock"][probe] == stock_error
    assert outcomes["fixed"][probe] == "OK"


def test_idempotent_and_cuda_untouched():
    from colossalai.accelerator.cuda_accelerator import CudaAccelerator

    from colossal_hetero.compat.cpu_support import apply_cpu_support, is_applied

    cuda_methods = dict(vars(CudaAccelerator))
    apply_cpu_support()
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    first = dict(vars(CpuAccelerator))
    apply_cpu_support()
    assert is_applied()
    assert dict(vars(CpuAccelerator)) == first
    assert dict(vars(CudaAccelerator)) == cuda_methods


def test_p2p_check_keeps_nccl_semantics_for_gloo_group():
    from colossal_hetero.compat.cpu_support import _is_nccl_like

    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=0, world_size=1)
        try:
            assert _is_nccl_like(None) is False
        finally:
            close_process_group()


def test_modeling_torch_view_is_torch_for_everything_else():
    from colossal_hetero.utils.device import torch_view_without_cpu_set_device

    view = torch_view_without_cpu_set_device()
    assert view.zeros is torch.zeros
    assert view.cuda.is_available is torch.cuda.is_available
    view.cuda.set_device(torch.device("cpu"))  # a no-op, not an error
