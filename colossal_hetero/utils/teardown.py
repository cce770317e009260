"""Leave the default process group without torch 2.5's gloo teardown deadlock."""

from __future__ import annotations

import gc
import time

import torch.distributed as dist

# Long enough for gloo's worker threads to drop the last finished op's tensors; short enough to
# be noise beside a spawn's seconds of imports.
SETTLE_S = 0.3


def close_process_group() -> None:
    """Destroy the default process group, if any, after letting its workers settle.

    In torch 2.5 ``ProcessGroupGloo``'s destructor joins its worker threads while holding the GIL
    (upstream releases it from pytorch PR #154976 on). A worker still dropping the last op's
    tensor needs the GIL when Python no longer references that tensor, and then both threads wait
    for ever, past any in-process timeout: pytest-timeout's signal cannot run without the GIL.
    So drop Python's unreachable references first, then pause with the GIL released so every
    worker finishes before the destructor runs. No collective is issued: on an error path the
    other ranks may be anywhere, and a barrier could pair with one of their pending ops.
    """
    if not dist.is_initialized():
        return
    gc.collect()
    time.sleep(SETTLE_S)
    dist.destroy_process_group()
