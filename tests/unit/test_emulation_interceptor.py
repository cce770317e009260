"""CollectiveInterceptor without a process group: installation and step accounting."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from colossal_hetero.config.schema import EmulationConfig, SlowdownSpec
from colossal_hetero.emulation import WRAPPED_NAMES, CollectiveInterceptor, build_interceptor
from colossal_hetero.emulation.schedule import SlowdownSchedule

CPU = torch.device("cpu")


def _busy(seconds: float) -> None:
    """Burn ``seconds`` of this thread's CPU time (the work the CPU emulation stretches)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_install_wraps_both_modules_and_uninstall_restores_originals() -> None:
    originals = {(m, n): getattr(m, n) for m in (dist, c10d) for n in WRAPPED_NAMES}
    with CollectiveInterceptor(0, 1, device=CPU) as interceptor:
        assert interceptor.installed
        for (module, name), original in originals.items():
            wrapper = getattr(module, name)
            assert wrapper is not original and wrapper.__wrapped__ is original
        assert dist.isend is c10d.isend  # P2POp checks op identity: isend/irecv stay as they are
    assert not interceptor.installed
    assert all(getattr(m, n) is fn for (m, n), fn in originals.items())
    interceptor.uninstall()  # a second uninstall is a no-op


def test_installing_one_interceptor_twice_is_refused() -> None:
    """Several interceptors may be installed (tests/unit/test_interceptor_sharing.py), but
    each once."""
    with CollectiveInterceptor(0, 1) as first:
        with pytest.raises(RuntimeError, match="already installed"):
            first.install()
    first.install().uninstall()  # free again once uninstalled


def test_step_bookkeeping_errors() -> None:
    interceptor = CollectiveInterceptor(0, 1)
    with pytest.raises(RuntimeError, match="install"):
        interceptor.begin_step(0)
    with interceptor:
        with pytest.raises(RuntimeError, match="without begin_step"):
            interceptor.end_step()
        interceptor.begin_step(0)
        with pytest.raises(RuntimeError, match="still open"):
            interceptor.begin_step(1)
        interceptor.end_step()


def test_timing_only_adds_no_sleep() -> None:
    emulation = EmulationConfig(compute=[SlowdownSpec(rank=1, factor=4.0)])  # another rank
    with build_interceptor(emulation, 0, 2, CPU) as interceptor:
        assert interceptor.slowdown is None and interceptor.network is None
        with interceptor.step(3):
            _busy(0.01)
    timing = interceptor.last_timing
    assert timing is not None and timing.step == 3
    assert timing.stretch_time == timing.network_delay == timing.comm_wait == 0.0
    assert timing.num_collectives == 0
    # 10 ms of this thread's CPU time take at least 10 ms of wall time; no upper bound, which a
    # loaded machine stretches (no sleep is checked by the accounting above).
    assert timing.compute_time == timing.step_time >= 0.01


def test_end_step_stretches_compute_without_collectives() -> None:
    slowdown = SlowdownSchedule.from_config(
        EmulationConfig(compute=[SlowdownSpec(rank=0, factor=3.0, start_step=1)]), 0
    )
    requested: list[float] = []  # the sleeps asked for, not slept: immune to machine load
    with CollectiveInterceptor(0, 1, slowdown, device=CPU, sleep=requested.append) as interceptor:
        for step in (0, 1):
            before = time.thread_time()
            interceptor.begin_step(step)
            _busy(0.02)
            interceptor.end_step()
            spent = time.thread_time() - before
    # One stretch, in step 1: twice the work done (factor 3). The work is this thread's CPU
    # time: at least the 0.02 s burnt, at most all of the thread's CPU time around the step
    # (_busy's last loop iteration and the bookkeeping add microseconds; a loaded VM's
    # accounting can add more, so no fixed margin).
    assert len(requested) == 1 and 2 * 0.02 <= requested[0] <= 2 * spent


def test_cpu_stretch_counts_work_not_waiting() -> None:
    """On a CPU rank, time not spent working (here: sleeping, as when waiting for a core the
    other ranks hold) is not stretched; only the CPU time is."""
    slowdown = SlowdownSchedule.from_config(
        EmulationConfig(compute=[SlowdownSpec(rank=0, factor=3.0)]), 0
    )
    requested: list[float] = []
    with CollectiveInterceptor(0, 1, slowdown, device=CPU, sleep=requested.append) as interceptor:
        before = time.thread_time()
        interceptor.begin_step(0)
        time.sleep(0.05)
        _busy(0.01)
        timing = interceptor.end_step()
        spent = time.thread_time() - before
    # Twice the CPU time, not the 0.06 s of wall time (that would ask for 0.12 s): at least the
    # 0.01 s burnt, at most all of this thread's CPU time around the step (the sleep's syscalls,
    # _busy's last iteration and the bookkeeping add to it; a loaded VM's accounting can too,
    # so no fixed margin).
    assert len(requested) == 1 and 2 * 0.01 <= requested[0] <= 2 * spent
    assert spent < 0.05  # the sleep is no CPU time: the bound above stays far below 0.12
    assert timing.compute_time >= 0.06


def test_dedicated_flush_starts_a_new_interval() -> None:
    """``dedicated``: a pass flushed with ``flush_compute`` is stretched to factor x its work
    less its wall time, and the next interval's wall time is counted from the flush (before,
    it was counted from the step start, so the interval after a flush was under-stretched)."""
    slowdown = SlowdownSchedule.from_config(
        EmulationConfig(compute=[SlowdownSpec(rank=0, factor=3.0)]), 0
    )
    wall = [0.0]  # a fake wall clock: each pass lasts exactly 0.02 s of it, whatever the load
    requested: list[float] = []
    interceptor = CollectiveInterceptor(
        0,
        1,
        slowdown,
        device=CPU,
        sleep=requested.append,
        clock=lambda: wall[0],
        stretch="dedicated",
    )
    spent: list[float] = []
    with interceptor:
        interceptor.begin_step(0)
        for _ in range(2):
            before = time.thread_time()
            _busy(0.02)
            wall[0] += 0.02
            interceptor.flush_compute()
            spent.append(time.thread_time() - before)
        interceptor.end_step()
    # Each pass: 3 x its work less its 0.02 s of wall time, 0.04 s for 0.02 s of work (the
    # second read 0.02 s before the fix). The work is CPU time: at least the 0.02 s burnt, at
    # most the thread's CPU time around the pass plus the little before it (loop and
    # bookkeeping; a loaded VM's accounting can add more, so no fixed margin). end_step's
    # interval holds only bookkeeping (microseconds of CPU time).
    assert len(requested) >= 2
    for asked, cpu in zip(requested[:2], spent, strict=True):
        assert 0.04 <= asked <= 3 * (cpu + 0.001) - 0.02
    assert sum(requested[2:]) < 0.002
