"""Spawn a function on several ranks: gloo on CPU, NCCL when there is one GPU per rank.

Check functions take keyword arguments ``rank``, ``world_size`` and ``device`` and never name
CUDA themselves. Group many checks into one spawn: each spawn costs seconds of imports.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from colossal_hetero.utils.device import backend_for, bind_device, cuda_device_count
from colossal_hetero.utils.teardown import close_process_group


def _entry(
    rank: int, world_size: int, init_file: str, fn: Callable[..., Any], kwargs: dict[str, Any]
) -> None:
    torch.set_num_threads(1)
    force_cpu = kwargs.pop("force_cpu", False)
    use_cuda = cuda_device_count() >= world_size and not force_cpu
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    bind_device(device)
    # Colossal-AI reads these to find its place; torchrun would set them.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    dist.init_process_group(
        backend_for(device), init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        fn(rank=rank, world_size=world_size, device=device, **kwargs)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        close_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, **kwargs: Any) -> None:
    """Run ``fn(rank=, world_size=, device=, **kwargs)`` on ``world_size`` spawned ranks.

    Raises if any rank raises. A file:// rendezvous avoids port races between tests.
    """
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(
            _entry,
            args=(world_size, os.path.join(folder, "init"), fn, kwargs),
            nprocs=world_size,
            join=True,
        )
