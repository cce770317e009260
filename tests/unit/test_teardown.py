"""close_process_group: a no-op without a group, destroys the default group after an op."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from colossal_hetero.utils.teardown import close_process_group


def test_close_is_a_noop_without_a_group_and_destroys_one_after_an_op() -> None:
    assert not dist.is_initialized()
    close_process_group()  # nothing to close: no error
    with tempfile.TemporaryDirectory() as folder:
        init = f"file://{os.path.join(folder, 'init')}"
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
        # The last op's tensor is dropped by Python at once: the case the settle pause is for.
        dist.all_reduce(torch.ones(4))
        close_process_group()
        assert not dist.is_initialized()
        close_process_group()  # twice is fine
