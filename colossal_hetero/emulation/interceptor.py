"""The single place where emulation acts: wrappers over torch.distributed collectives.

Between two collectives a rank computes; at each collective the interceptor
  (a) stretches that compute: sleeps ``(factor - 1) * t`` where ``t`` is the work done since the
      previous collective (or step start), so a slow rank really arrives late, by an amount
      that scales with the work it really did (counted as compute). ``t`` is the thread's CPU
      time on CPU ranks (ranks share the host's cores: time spent waiting for a core is not
      work, and stretching it would slow the rank for its neighbours' load) and wall time
      after a device sync on accelerators;
  (b) runs the real collective and times it (communication wait);
  (c) sleeps the network model's time for the call after it completes (communication);
  (d) starts the next compute interval.
Async calls are timed at issue; their ``wait()`` is a boundary like a collective, and pays the
modelled delay. With neither a slowdown nor a network model the interceptor only times: no
sleeps and no cost model, just a clock read after a device sync on each side of a call.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from colossal_hetero.emulation.collectives import (
    COST_FNS,
    WRAPPED_NAMES,
    CallArgs,
    CostFn,
    ModelContext,
    parameter_positions,
)
from colossal_hetero.emulation.network import NetworkModel
from colossal_hetero.emulation.schedule import SlowdownSchedule
from colossal_hetero.emulation.timing import StepTiming
from colossal_hetero.utils.device import synchronize

# Colossal-AI calls `dist.X` at call time, and torch's own helpers (all_gather_object calling
# all_gather) resolve names in distributed_c10d: both modules must see the wrappers.
_MODULES: tuple[ModuleType, ...] = (dist, c10d)
_installed: CollectiveInterceptor | None = None  # at most one per process, or calls nest twice


class CollectiveInterceptor:
    """Wraps torch.distributed collectives to emulate a slow device and slow links, and to time
    every step's compute and communication.

    Emulation and timing act only between ``begin_step`` and ``end_step`` and only in the thread
    that called ``install``; other calls run unchanged. Async calls (``async_op=True``,
    ``batch_isend_irecv``) return proxies whose ``wait()`` is timed and applies the modelled
    delay once; the proxies forward every other attribute to the real work.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        slowdown: SlowdownSchedule | None = None,
        network: NetworkModel | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.slowdown = slowdown if slowdown is not None and slowdown.enabled else None
        self.network = network if network is not None and network.enabled else None
        self.device = device if device is not None else torch.device("cpu")
        self.last_timing: StepTiming | None = None
        self._originals: dict[tuple[ModuleType, str], Callable[..., Any]] = {}
        self._thread: int | None = None
        self._depth = 0  # > 0 while an intercepted collective runs: its nested calls pass through
        self._nested_delay: float | None = None  # summed here for object collectives only
        self._step: int | None = None  # None outside begin_step / end_step
        self._reset(time.perf_counter())

    # -- installation -------------------------------------------------------------------------

    @property
    def installed(self) -> bool:
        """Whether the wrappers are in place."""
        return bool(self._originals)

    def install(self) -> CollectiveInterceptor:
        """Put the wrappers on ``torch.distributed`` and ``distributed_c10d``; returns self.

        Raises RuntimeError if this or another interceptor is already installed.
        """
        global _installed
        if _installed is not None:
            raise RuntimeError("a CollectiveInterceptor is already installed in this process")
        wrappers: dict[int, Callable[..., Any]] = {}  # one wrapper per distinct original
        for module in _MODULES:
            for name in WRAPPED_NAMES:
                original = getattr(module, name)
                if id(original) not in wrappers:
                    wrappers[id(original)] = self._wrap(name, original)
                self._originals[(module, name)] = original
                setattr(module, name, wrappers[id(original)])
        self._thread = threading.get_ident()
        _installed = self
        return self

    def uninstall(self) -> None:
        """Restore the exact original functions; a no-op when not installed.

        An open step is abandoned; wrappers that callers still hold then pass calls through.
        """
        global _installed
        self._step = None
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        self._originals.clear()
        if _installed is self:
            _installed = None

    def __enter__(self) -> CollectiveInterceptor:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -- steps --------------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Start timing ``step``; its slowdown and network factors apply until ``end_step``.

        Time between ``end_step`` and ``begin_step`` (data loading, logging) is neither timed
        nor stretched.
        """
        if not self.installed:
            raise RuntimeError("install() the interceptor before begin_step()")
        if self._step is not None:
            raise RuntimeError(f"begin_step({step}) while step {self._step} is still open")
        synchronize(self.device)
        self._reset(time.perf_counter())
        self._step = step

    def end_step(self) -> StepTiming:
        """Stretch the compute since the last collective, close the step and return its timing.

        Flushing here means compute that ends a step, or a step with no collective at all (a
        single rank), is stretched too.
        """
        if self._step is None:
            raise RuntimeError("end_step() without begin_step()")
        now = self._arrive()
        step_time = now - self._step_start
        self.last_timing = StepTiming(
            step=self._step,
            step_time=step_time,
            compute_time=step_time - self._comm_wait,
            comm_wait=self._comm_wait,
            stretch_time=self._stretch_time,
            network_delay=self._network_delay,
            num_collectives=self._num_collectives,
        )
        self._step = None
        return self.last_timing

    @contextmanager
    def step(self, step: int) -> Iterator[CollectiveInterceptor]:
        """``begin_step(step)`` ... ``end_step()``; the timing is then in ``last_timing``."""
        self.begin_step(step)
        try:
            yield self
        finally:
            self.end_step()

    # -- the wrappers -------------------------------------------------------------------------

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        positions, cost = parameter_positions(original), COST_FNS[name]
        returns_works = name == "batch_isend_irecv"  # always async: a list of works

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._step is None or threading.get_ident() != self._thread:
                return original(*args, **kwargs)
            if self._depth:
                return self._run_nested(original, cost, CallArgs(positions, args, kwargs))
            call = CallArgs(positions, args, kwargs)
            return self._run(original, cost, call, returns_works or call.get("async_op", False))

        return wrapper

    def _run(
        self, original: Callable[..., Any], cost: CostFn | None, call: CallArgs, is_async: bool
    ) -> Any:
        """One outermost collective: stretch, run it timed, then the network delay."""
        start = self._arrive()
        self._nested_delay = 0.0 if cost is None and self.network is not None else None
        self._depth += 1
        try:
            result = original(*call.args, **call.kwargs)
        finally:
            self._depth -= 1
            nested_delay, self._nested_delay = self._nested_delay or 0.0, None
        delay = nested_delay + self._model(cost, call, result)
        self._num_collectives += 1
        if is_async:
            # No sync after issue: on a GPU it would wait for the collective and kill overlap.
            self._finish_comm(start, sync=False)
            return self._proxy(result, _PendingDelay(delay))
        self._sleep_network(delay)
        self._finish_comm(start, sync=True)
        return result

    def _run_nested(self, original: Callable[..., Any], cost: CostFn | None, call: CallArgs) -> Any:
        """A collective called by an intercepted one: only its modelled time is kept."""
        result = original(*call.args, **call.kwargs)
        if self._nested_delay is not None:
            self._nested_delay += self._model(cost, call, result)
        return result

    def _wait(self, work: Any, pending: _PendingDelay, args: Any, kwargs: Any) -> Any:
        """``wait()`` of a proxy: a boundary like a collective, plus the deferred delay."""
        if self._step is None or threading.get_ident() != self._thread or self._depth:
            result = work.wait(*args, **kwargs)
            delay = pending.take()
            if delay > 0.0:  # still owed, but outside a step nothing is accounted
                time.sleep(delay)
            return result
        start = self._arrive()
        result = work.wait(*args, **kwargs)
        self._sleep_network(pending.take())
        self._finish_comm(start, sync=True)
        return result

    # -- accounting ---------------------------------------------------------------------------

    def _reset(self, now: float) -> None:
        self._step_start = self._boundary = now
        self._work_boundary = self._work_clock()
        self._comm_wait = self._stretch_time = self._network_delay = 0.0
        self._num_collectives = 0

    def _arrive(self) -> float:
        """Close the compute interval since the last boundary, stretched; returns the clock."""
        synchronize(self.device)
        now = time.perf_counter()
        step = self._step if self._step is not None else 0
        factor = 1.0 if self.slowdown is None else self.slowdown.factor_at(step)
        if factor > 1.0:
            time.sleep((factor - 1.0) * (self._work_clock() - self._work_boundary))
            stretched = time.perf_counter()
            self._stretch_time += stretched - now
            now = stretched
        return now

    def _work_clock(self) -> float:
        """Seconds of work this rank did: its thread's CPU time on a CPU device, where ranks
        share cores and wall time would count waiting for a core as work (and stretch it by the
        slowdown factor); wall time on an accelerator, after the device sync."""
        return time.thread_time() if self.device.type == "cpu" else time.perf_counter()

    def _finish_comm(self, start: float, *, sync: bool) -> None:
        if sync:
            synchronize(self.device)
        self._boundary = time.perf_counter()
        self._work_boundary = self._work_clock()
        self._comm_wait += self._boundary - start

    def _model(self, cost: CostFn | None, call: CallArgs, result: Any) -> float:
        if self.network is None or cost is None:
            return 0.0
        step = self._step if self._step is not None else 0
        ctx = ModelContext(self.network, self.rank, self.world_size, step)
        return cost(ctx, call, result)

    def _sleep_network(self, delay: float) -> None:
        if delay > 0.0:
            before = time.perf_counter()
            time.sleep(delay)
            # What was really slept: on a loaded machine sleeps overrun, and that is link time.
            self._network_delay += time.perf_counter() - before

    def _proxy(self, result: Any, pending: _PendingDelay) -> Any:
        if isinstance(result, list):  # batch_isend_irecv: one delay shared by the batch
            return [_WorkProxy(self, work, pending) for work in result]
        return None if result is None else _WorkProxy(self, result, pending)


class _PendingDelay:
    """A modelled delay owed by an async call; the first wait that takes it pays it."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class _WorkProxy:
    """Stands in for a torch.distributed Work: ``wait()`` is timed and delayed, all else
    forwards to the real work."""

    __slots__ = ("_owner", "_work", "_pending")

    def __init__(self, owner: CollectiveInterceptor, work: Any, pending: _PendingDelay) -> None:
        self._owner, self._work, self._pending = owner, work, pending

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._owner._wait(self._work, self._pending, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
