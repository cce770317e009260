"""Route torch DDP's gradient all-reduces through the collective interceptor.

DDP reduces gradient buckets from C++ (its reducer calls the process group directly), so the
Python-level wrappers of the interceptor never see them: an emulated link would not slow them
and an emulated slow rank would not arrive late at them. Under emulation, a comm hook makes each
bucket a Python ``dist.all_reduce`` (then divides by the group size, as DDP does), which the
interceptor stretches, times and delays like any other collective.

The hook is synchronous: it gives up DDP's overlap of communication with the rest of backward,
which is why it is installed only when emulating, never on a production run.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as real types.
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

_HOOKED = "_colossal_hetero_routed"  # marks a DDP whose hook is already ours


def find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The torch DDP inside a booster's wrapper (``model.module``), or ``model`` itself."""
    for candidate in (model, getattr(model, "module", None)):
        if isinstance(candidate, DistributedDataParallel):
            return candidate
    return None


def route_ddp_through_interceptor(model: nn.Module) -> bool:
    """Install the synchronous all-reduce hook on the DDP in ``model``; True if it has one now.

    Idempotent. Must run before the first backward (DDP accepts one hook, set before use).
    """
    ddp = find_ddp(model)
    if ddp is None:
        return False
    if not getattr(ddp, _HOOKED, False):
        ddp.register_comm_hook(ddp.process_group, _allreduce_in_python)
        setattr(ddp, _HOOKED, True)
    return True


def _allreduce_in_python(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one bucket over ``group`` with a (wrapped) synchronous ``dist.all_reduce``."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer, group=group)
    buffer.div_(dist.get_world_size(group))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
