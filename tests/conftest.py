"""Pytest configuration shared by every test: the report header names the CPU kernels used.

A float comparison that fails on one machine and passes on another usually differs in the
kernels that ran (AVX2 or AVX-512 ATen loops, MKL's and oneDNN's code paths), so every report
starts with them and with the environment variables that force them.
"""

from __future__ import annotations

import os
import platform
import re

import torch

from colossal_hetero.utils.quiet import no_idle_compile_workers

# Before any test imports colossalai; spawned ranks inherit it (see the function).
no_idle_compile_workers()

# Variables that pick or limit CPU kernels (ATen's dispatch, MKL's and oneDNN's ISA), and the
# thread count, which changes how reductions are split.
KERNEL_ENV = (
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "OMP_NUM_THREADS",
)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernel_report() -> list[str]:
    """Lines naming the CPU, the kernel set ATen dispatches to, MKL's and oneDNN's versions
    and the kernel-forcing environment variables in force."""
    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version (\S+)", config)
    onednn = re.search(r"MKL-DNN v(\S+)", config)
    overrides = [f"{name}={os.environ[name]}" for name in KERNEL_ENV if name in os.environ]
    return [
        f"cpu: {_cpu_model()}; torch {torch.__version__}, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}",
        f"kernels: MKL {mkl.group(1) if mkl else 'absent'} "
        f"(enabled: {torch.backends.mkl.is_available()}), "
        f"oneDNN {onednn.group(1) if onednn else 'absent'} "
        f"(enabled: {torch.backends.mkldnn.is_available()})",
        f"kernel env: {' '.join(overrides) if overrides else 'none (defaults)'}",
    ]


def pytest_report_header(config: object) -> list[str]:
    return kernel_report()
