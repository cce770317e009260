"""``bench moe``'s emulated devices (bench/moe_devices.py): the emulation every variant shares,
the dedicated stretch of a scoped step, and the process-group count that finds a collective
the interceptor did not see. A one-rank gloo group in this process lets the calls really run.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from colossal_hetero.bench.moe_devices import (
    DEVICE_BASE,
    CollectiveTimer,
    boundary_summary,
    counting_pg_calls,
    device_emulation,
    emulated_devices,
    scoped_step,
    stretch_interceptor,
)
from colossal_hetero.utils.teardown import close_process_group

CPU = torch.device("cpu")


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(folder, 'init')}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            close_process_group()


def test_every_rank_gets_the_same_device_and_none_means_no_emulation() -> None:
    dedicated = device_emulation(4, "dedicated")
    assert [(s.rank, s.factor, s.start_step, s.end_step) for s in dedicated.slowdowns] == [
        (r, DEVICE_BASE, 0, None) for r in range(4)
    ]
    assert not device_emulation(4, "none").enabled
    with pytest.raises(ValueError, match="stretch"):
        device_emulation(4, "added")


@pytest.mark.usefixtures("one_rank_group")
def test_a_collective_bound_before_the_interceptor_is_counted_as_missed() -> None:
    bound_early = c10d.all_reduce  # as a library that keeps the function it found at import
    group_type = torch._C._distributed_c10d.ProcessGroup
    before = group_type.allreduce
    buf = torch.ones(8)
    clock = stretch_interceptor(device_emulation(1, "none"), CPU, "none")
    try:
        with counting_pg_calls() as counter:
            dist.all_reduce(buf)  # outside a watched step: not counted
            with scoped_step(clock, counter, 0) as seen:
                dist.all_reduce(buf)  # seen by the interceptor
                dist.all_reduce(buf, async_op=True).wait()  # seen (issue; wait is no call)
                bound_early(buf)  # the original function: the interceptor never sees it
            assert group_type.allreduce is not before
        assert seen == {"pg_calls": 3.0, "missed": 1.0}
        assert clock.last_timing.num_collectives == 2
    finally:
        clock.uninstall()
    assert group_type.allreduce is before  # restored


@pytest.mark.usefixtures("one_rank_group")
def test_dedicated_step_lasts_base_times_its_cpu_work() -> None:
    clock = stretch_interceptor(device_emulation(1, "dedicated"), CPU, "dedicated")
    a = torch.randn(256, 256)
    try:
        with counting_pg_calls() as counter:
            with scoped_step(clock, counter, 0):
                cpu = time.thread_time()
                for _ in range(20):
                    a = torch.tanh(a @ a)
                cpu = time.thread_time() - cpu
        # The interceptor sleeps until the interval's wall time is DEVICE_BASE x its thread CPU
        # time, which holds my work's: a lower bound whatever else runs on the machine.
        assert clock.last_timing.step_time >= DEVICE_BASE * cpu
        assert clock.last_timing.stretch_time > 0
    finally:
        clock.uninstall()


@pytest.mark.usefixtures("one_rank_group")
def test_the_timer_beneath_the_interceptor_times_a_call_from_after_the_stretch() -> None:
    a, buf = torch.randn(256, 256), torch.ones(8)
    with CollectiveTimer().installed() as timer:
        with emulated_devices(1, CPU, "dedicated") as devices:
            assert devices.timer is not timer and devices.clock.stretch == "dedicated"
        clock = stretch_interceptor(device_emulation(1, "dedicated"), CPU, "dedicated")
        try:
            with pytest.raises(RuntimeError, match="before any interceptor"):
                with CollectiveTimer().installed():
                    pass
            with counting_pg_calls() as counter, timer.recording() as calls:
                begin = time.perf_counter()
                with scoped_step(clock, counter, 0):
                    cpu = time.thread_time()
                    for _ in range(20):
                        a = torch.tanh(a @ a)
                    cpu = time.thread_time() - cpu
                    dist.all_reduce(buf)
                    dist.all_reduce(buf, async_op=True).wait()  # async: not timed
        finally:
            clock.uninstall()
    assert len(calls) == 1 and calls[0][2] == (0,)
    # The interceptor slept the compute up to DEVICE_BASE x its CPU time before the call
    # reached the timer: the call starts no earlier (timed above the interceptor, it would
    # start right after the work, before the sleep).
    assert calls[0][0] >= begin + DEVICE_BASE * cpu


def test_boundary_summary_takes_the_worst_step() -> None:
    series = {
        "stock.step": [0.1, 0.2],
        "stock.pg_calls": [12.0, 14.0],
        "stock.missed": [0.0, 0.0],
        "deepspeed.pg_calls": [30.0, 30.0],
        "deepspeed.missed": [0.0, 2.0],
    }
    assert boundary_summary(series) == {
        "deepspeed": {"pg_calls_per_step": 30.0, "missed_max": 2.0},
        "stock": {"pg_calls_per_step": 14.0, "missed_max": 0.0},
    }
