"""Run a function on several local ranks and collect each rank's JSON-able result.

Benchmarks use it like the tests use tests/dist_utils.py: gloo on CPU, NCCL with one GPU per
rank. Results travel through files, so a rank's return value must be JSON-serialisable.
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from colossal_hetero.utils.device import backend_for, bind_device, local_device
from colossal_hetero.utils.quiet import no_idle_compile_workers, quiet_optional_kernel_warnings
from colossal_hetero.utils.teardown import close_process_group


def _entry(rank: int, world_size: int, folder: str, payload: bytes) -> None:
    # The function and its arguments travel pickled and are unpickled only here, after the
    # filters: unpickling imports their modules (and colossalai with them), which would print
    # its import-time notices on every rank before this body ran.
    quiet_optional_kernel_warnings()
    no_idle_compile_workers()
    fn, kwargs = pickle.loads(payload)
    torch.set_num_threads(1)
    device = local_device(rank, world_size)
    bind_device(device)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    dist.init_process_group(
        backend_for(device), init_method=f"file://{folder}/init", rank=rank, world_size=world_size
    )
    try:
        result = fn(rank=rank, world_size=world_size, device=device, **kwargs)
        with open(os.path.join(folder, f"result_{rank}.json"), "w") as handle:
            json.dump(result, handle)
    finally:
        close_process_group()


def spawn_ranks(fn: Callable[..., Any], world_size: int, **kwargs: Any) -> list[Any]:
    """``[fn(rank=r, world_size=, device=, **kwargs) for r in ranks]``, each in its own process."""
    with tempfile.TemporaryDirectory() as folder:
        payload = pickle.dumps((fn, kwargs))
        mp.spawn(_entry, args=(world_size, folder, payload), nprocs=world_size, join=True)
        results = []
        for rank in range(world_size):
            with open(os.path.join(folder, f"result_{rank}.json")) as handle:
                results.append(json.load(handle))
    return results
