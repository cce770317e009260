"""Process start-up: pick the device, prepare Colossal-AI for it, join the process group."""

from __future__ import annotations

import os

import torch

from colossal_hetero.config.schema import ClusterConfig
from colossal_hetero.utils.device import (
    backend_for,
    bind_device,
    is_host_device,
    resolve_device,
)


def prepare_device(device: torch.device) -> None:
    """Point Colossal-AI's accelerator at ``device``; on CPU, install the CPU/gloo fixes.

    Idempotent. Must run before ``colossalai.launch*``, which picks its backend from the
    accelerator.
    """
    from colossalai.accelerator import set_accelerator

    if is_host_device(device):
        from colossal_hetero.compat.cpu_support import apply_cpu_support

        apply_cpu_support()
    set_accelerator(device.type)
    bind_device(device)


def init_distributed(cluster: ClusterConfig, seed: int = 0) -> torch.device:
    """Join the torchrun/colossalai-run process group on the configured device.

    Reads RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE from the environment.
    Returns this rank's device.
    """
    import colossalai

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    device = resolve_device(cluster.device, local_rank, local_world_size)
    prepare_device(device)
    colossalai.launch_from_torch(backend=backend_for(device), seed=seed, verbose=False)
    return device
