"""The single place where emulation acts: wrappers over torch.distributed collectives.

Between two collectives a rank computes; at each collective the interceptor
  (a) stretches that compute: sleeps ``(factor - 1) * t`` where ``t`` is the work done since the
      previous collective (or step start), so a slow rank really arrives late, by an amount
      that scales with the work it really did (counted as compute). ``t`` is the thread's CPU
      time on CPU ranks (ranks share the host's cores: time spent waiting for a core is not
      work, and stretching it would slow the rank for its neighbours' load) and wall time
      after a device sync on accelerators;
  (b) runs the real collective and times it (communication wait), by kind (``COMM_KINDS``),
      counting the bytes it sends;
  (c) books the call's modelled transfer on the class of this rank's link it uses (a listed
      link's own, else the default class: ``NetworkModel.link_class``), a ``LinkTimeline``
      each: per direction, the receiver's ready notice and the data each wait behind a
      bounded queue, then the rate is shared among process groups, each group in order),
      from when the real call returned, and sleeps until the transfer completes;
  (d) starts the next compute interval.
Async calls book their transfer at issue, so it runs while the rank computes; their ``wait()``
is a boundary like a collective and sleeps only what remains of the transfer. A single isend or
irecv on a host backend completes no sooner than its real data moved plus its modelled time
(``arrival``): a receive is booked when its data arrives, not when it was posted. With neither a
slowdown nor a network model the interceptor only times and counts bytes: no sleeps, no model.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from colossal_hetero.config.schema import EmulationConfig
from colossal_hetero.emulation.arrival import ArrivalLink, CompletionWatch, Stamp, StreamOrder
from colossal_hetero.emulation.collectives import (
    ALWAYS_ASYNC,
    COLLECTIVES,
    WATCHED_P2P,
    CallArgs,
    Collective,
    ModelContext,
    Transfer,
    parameter_positions,
)
from colossal_hetero.emulation.link_timeline import Booking, LinkClasses
from colossal_hetero.emulation.network import NetworkModel
from colossal_hetero.emulation.router import CollectiveRouter
from colossal_hetero.emulation.schedule import SlowdownSchedule
from colossal_hetero.emulation.timing import COMM_KINDS, StepTiming, zero_by_kind
from colossal_hetero.utils.device import (
    host_device,
    is_host_device,
    synchronize,
    waits_block_host,
)


class CollectiveInterceptor:
    """Wraps torch.distributed collectives to emulate a slow device and slow links, and to time
    every step's compute and communication.

    Emulation and timing act only between ``begin_step`` and ``end_step`` and only in the thread
    that called ``install``; other calls run unchanged. Async calls (``async_op=True``,
    ``batch_isend_irecv``) return proxies whose ``wait()`` is timed and sleeps what remains of
    the modelled transfer; the proxies forward every other attribute to the real work.

    Several interceptors may be installed at once (several plugins in one process): they share
    one wrapper layer (``router.CollectiveRouter``), which hands each call to the interceptor
    whose step is open in the calling thread.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        slowdown: SlowdownSchedule | None = None,
        network: NetworkModel | None = None,
        device: torch.device | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
        stretch: Literal["added", "dedicated"] = "added",
    ) -> None:
        """``sleep`` and ``clock`` are seams for tests: every emulated delay is one call of
        ``sleep`` and every timing reads ``clock`` (the CPU work clock stays the thread's).

        ``stretch``: how a slowed rank's compute interval is lengthened. ``added`` sleeps
        ``(factor - 1) x`` the interval's work on top of its wall time. ``dedicated`` makes the
        interval last ``factor x`` its work, sleeping only what the real (possibly contended)
        wall time left: contention up to the factor is absorbed, as on a device of its own.
        Both scale with the work the rank really did."""
        self.rank, self.world_size = rank, world_size
        self.stretch = stretch
        self._sleep, self._clock = sleep, clock
        # This rank's link, one timeline per class, kept across steps as transfers are.
        self._links = (
            LinkClasses(network.queue, network.rendezvous) if network is not None else LinkClasses()
        )
        self.slowdown = slowdown if slowdown is not None and slowdown.enabled else None
        self.network = network if network is not None and network.enabled else None
        self.device = device if device is not None else host_device()
        self.last_timing: StepTiming | None = None
        self._router: CollectiveRouter | None = None  # set while installed
        # The whole world's emulation this was built from (build_interceptor sets it): the
        # router compares it, not this rank's models, so that every rank refuses a conflict.
        self.emulation: EmulationConfig | None = None
        self._handlers: dict[int, Callable[..., Any]] = {}  # id(original) -> its wrapper
        self._thread: int | None = None
        self._depth = 0  # > 0 while an intercepted collective runs: its nested calls pass through
        self._nested: Transfer | None = None  # summed here for object collectives only
        self._step: int | None = None  # None outside begin_step / end_step
        self._overslept = 0.0  # stretch slept beyond what was asked, taken off the next sleeps
        self._order = StreamOrder()  # watched p2p messages, kept in order per connection
        self._completions = CompletionWatch(clock)  # their real completions, stamped
        self._arrivals = ArrivalLink(self._links.queue)  # stamped receives, booked on arrival
        self.network_step: Callable[[], int] | None = None
        """Where the network model reads its step-scheduled preemptions (None: the step being
        timed). A benchmark that steps several jobs side by side in rounds sets it to the
        running round, as the shaped launcher's tenant follows the rounds it is told."""
        self._reset(self._clock())

    # -- installation -------------------------------------------------------------------------

    @property
    def installed(self) -> bool:
        """Whether this interceptor is attached to the wrappers on torch.distributed."""
        return self._router is not None

    def install(self) -> CollectiveInterceptor:
        """Attach to the process's wrappers on ``torch.distributed`` and ``distributed_c10d``
        (installed with the first interceptor); returns self.

        Raises:
            RuntimeError: this interceptor is installed already.
            ValueError: another installed interceptor emulates a different cluster
                (see ``router.compatible``); nothing is installed then.
        """
        router = CollectiveRouter.shared()
        router.attach(self)
        self._router = router
        self._handlers = {
            id(original): self._wrap(name, original)
            for name, original in router.originals().items()
        }
        self._thread = threading.get_ident()
        return self

    def uninstall(self) -> None:
        """Detach; the last interceptor to go restores the exact original functions. A no-op
        when not installed.

        An open step is abandoned; wrappers that callers still hold then pass calls through.
        """
        self._step = None
        self._completions.close()
        if self._router is not None:
            self._router.detach(self)
        self._router = None
        self._handlers = {}

    def stepping_here(self) -> bool:
        """Whether a step is open in the calling thread (calls there are this interceptor's)."""
        return self._step is not None and threading.get_ident() == self._thread

    def intercept(
        self, name: str, original: Callable[..., Any], args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        """Run one call of ``original`` (torch.distributed's ``name``) under this interceptor;
        the router calls it for calls made in this interceptor's open step."""
        handler = self._handlers.get(id(original))
        if handler is None:  # an original the router did not list: wrap it on first use
            handler = self._handlers[id(original)] = self._wrap(name, original)
        return handler(*args, **kwargs)

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
        assert self._router is not None  # installed: checked above
        self._router.check_free(self)  # one open step per thread, over all interceptors
        synchronize(self.device)
        self._reset(self._clock())
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
            bytes_by_kind=self._bytes,
            wait_by_kind=self._waits,
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

    def flush_compute(self) -> None:
        """Stretch the compute since the last boundary now, not at the next collective.

        For callers that time their own compute (the pipeline schedule times each pass): the
        slowdown of a pass then lands in the pass, not in the wait that follows it. A no-op
        without a slowdown, outside a step, in another thread or inside a collective.
        """
        if self.slowdown is None or not self.stepping_here() or self._depth:
            return
        # Both clocks restart here: the dedicated stretch sets the next interval's work against
        # its own wall time, not the flushed pass's too.
        self._boundary = self._arrive()
        self._work_boundary = self._work_clock()

    # -- the wrappers -------------------------------------------------------------------------

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        positions, spec = parameter_positions(original), COLLECTIVES[name]
        returns_works = name in ALWAYS_ASYNC  # works to wait on, whatever the arguments
        watched = name in WATCHED_P2P

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._step is None or threading.get_ident() != self._thread:
                return original(*args, **kwargs)
            if self._depth:
                return self._run_nested(original, spec, CallArgs(positions, args, kwargs))
            call = CallArgs(positions, args, kwargs)
            is_async = returns_works or call.get("async_op", False)
            return self._run(original, spec, call, is_async, watched)

        return wrapper

    def _run(
        self,
        original: Callable[..., Any],
        spec: Collective,
        call: CallArgs,
        is_async: bool,
        watched: bool = False,
    ) -> Any:
        """One outermost collective: stretch, run it timed, book its transfer on the link and,
        for a synchronous call, sleep until that transfer completes. ``watched``: a single
        non-blocking p2p call (``WATCHED_P2P``), whose real completion is stamped where the
        host can see it (see ``arrival``)."""
        start = self._arrive()
        self._nested = Transfer() if spec.sent is None else None
        self._depth += 1
        try:
            result = original(*call.args, **call.kwargs)
        finally:
            self._depth -= 1
            nested, self._nested = self._nested or Transfer(), None
        transfer = nested + self._transfer(spec, call, result)
        self._num_collectives += 1
        self._bytes[spec.kind] += transfer.sent
        if is_async:
            # Issued at `start`: it runs while the rank computes, behind what is already booked.
            stamped = watched and transfer.seconds > 0 and result is not None
            stamped = stamped and waits_block_host(self.device)
            booking = None
            if not (stamped and transfer.egress == 0):  # a stamped receive books on arrival
                # A stamped send's rendezvous is real: its data moves, and is stamped, only once
                # the receive is posted, so the modelled notice is not charged on top.
                booking = self._book(start, transfer, rendezvous=False if stamped else None)
            pending = _Pending(spec.kind, transfer.seconds, booking)
            if stamped:
                self._watch(pending, result, call, transfer)
            # No sync after issue: on a GPU it would wait for the collective and kill overlap.
            self._finish_comm(start, spec.kind, sync=False)
            return self._proxy(result, pending)
        if transfer.seconds > 0:
            # The real call returned, so every participant has arrived: the transfer starts now.
            synchronize(self.device)
            self._sleep_until(self._book(self._clock(), transfer).completion, accounted=True)
        self._finish_comm(start, spec.kind, sync=True)
        return result

    def _run_nested(self, original: Callable[..., Any], spec: Collective, call: CallArgs) -> Any:
        """A collective called by an intercepted one: what it moves is kept only when the outer
        call (an object collective) counts its nested calls."""
        result = original(*call.args, **call.kwargs)
        if self._nested is not None:
            self._nested += self._transfer(spec, call, result)
        return result

    def _watch(self, pending: _Pending, work: Any, call: CallArgs, transfer: Transfer) -> None:
        """Stamp when ``work`` (an isend's or irecv's, on a host backend) really completes: its
        message then lands no sooner than that plus its modelled time, in order per connection
        and direction (``arrival``)."""
        sends = transfer.egress > 0
        peer = call.get("dst") if sends else call.get("src")
        pending.key = (transfer.stream, sends, peer, call.get("tag", 0))
        pending.sequence = self._order.issue()
        arrival = None if sends else (self._arrivals, transfer.ingress, transfer.link)
        pending.watch = self._completions.watch(pending.key, work, arrival)

    def _wait(self, work: Any, pending: _Pending, args: Any, kwargs: Any) -> Any:
        """``wait()`` of a proxy: a boundary like a collective; sleeps what remains of the
        transfer (outside a step too, but accounted only inside)."""
        accounted = self._step is not None and threading.get_ident() == self._thread
        accounted = accounted and not self._depth
        start = self._arrive() if accounted else 0.0
        done = pending.seconds == 0 or pending.settled or pending.all_done()
        before = self._clock()
        if pending.watch is not None:
            result, moved_at = pending.watch.join()
        else:
            result = work.wait(*args, **kwargs)
        if pending.seconds > 0:
            synchronize(self.device)
            now = self._clock()
            if pending.watch is not None:
                deadline = pending.settle_moved(self._order, self._arrivals, moved_at)
            else:
                late = not done and pending.late(now - before)
                deadline = pending.settle(now, late=late)
            self._sleep_until(deadline, accounted)
        if accounted:
            self._finish_comm(start, pending.kind, sync=True)
        return result

    # -- accounting ---------------------------------------------------------------------------

    def _reset(self, now: float) -> None:
        self._step_start = self._boundary = now
        self._work_boundary = self._work_clock()
        self._comm_wait = self._stretch_time = self._network_delay = 0.0
        self._num_collectives = 0
        self._bytes: dict[str, int] = dict.fromkeys(COMM_KINDS, 0)
        self._waits = zero_by_kind()

    def _arrive(self) -> float:
        """Close the compute interval since the last boundary, stretched; returns the clock."""
        synchronize(self.device)
        now = self._clock()
        step = self._step if self._step is not None else 0
        factor = 1.0 if self.slowdown is None else self.slowdown.factor_at(step)
        if factor > 1.0 and self.stretch == "dedicated":
            want = factor * (self._work_clock() - self._work_boundary) - (now - self._boundary)
            if want > 0:
                self._sleep(want)
            stretched = self._clock()
            self._stretch_time += stretched - now
            now = stretched
        elif factor > 1.0:
            # A loaded host wakes a sleeper late; the overshoot is owed back by the next sleeps,
            # so the stretch follows the work done, not the number of collectives it spans.
            want = (factor - 1.0) * (self._work_clock() - self._work_boundary) - self._overslept
            self._overslept = max(-want, 0.0)
            if want > 0:
                self._sleep(want)
                stretched = self._clock()
                self._overslept = max(stretched - now - want, 0.0)
                self._stretch_time += stretched - now
                now = stretched
        return now

    def _work_clock(self) -> float:
        """Seconds of work this rank did: its thread's CPU time on a CPU device, where ranks
        share cores and wall time would count waiting for a core as work (and stretch it by the
        slowdown factor); wall time on an accelerator, after the device sync."""
        return time.thread_time() if is_host_device(self.device) else self._clock()

    def _finish_comm(self, start: float, kind: str, *, sync: bool) -> None:
        if sync:
            synchronize(self.device)
        self._boundary = self._clock()
        self._work_boundary = self._work_clock()
        self._comm_wait += self._boundary - start
        self._waits[kind] += self._boundary - start

    def _transfer(self, spec: Collective, call: CallArgs, result: Any) -> Transfer:
        """What ``call`` moves: its bytes always, its modelled times under a network model."""
        ctx = None
        if self.network is not None:
            step = self._step if self._step is not None else 0
            if self.network_step is not None:
                step = self.network_step()
            ctx = ModelContext(self.network, self.rank, self.world_size, step)
        return spec.transfer(call, result, self.rank, ctx)

    def _book(self, issue: float, transfer: Transfer, rendezvous: bool | None = None) -> Booking:
        """``transfer`` issued at ``issue``, booked on its class of this rank's link
        (``rendezvous``: see ``LinkTimeline.book``)."""
        link = self._links.timeline(transfer.link)
        return link.book(issue, transfer.egress, transfer.ingress, transfer.stream, rendezvous)

    def _sleep_until(self, deadline: float, accounted: bool) -> None:
        """Sleep what remains until a transfer completes at ``deadline``; counted as network
        delay as really slept (on a loaded machine sleeps overrun, and that is link time)."""
        before = self._clock()
        if deadline > before:
            self._sleep(deadline - before)
            if accounted:
                self._network_delay += self._clock() - before

    def _proxy(self, result: Any, pending: _Pending) -> Any:
        if result is None:
            return None
        works = result if isinstance(result, list) else [result]
        pending.works = tuple(works)  # batch_isend_irecv: one transfer shared by the batch
        proxies = [_WorkProxy(self, work, pending) for work in works]
        return proxies if isinstance(result, list) else proxies[0]


# A wait that blocks longer than this share of the transfer's modelled time (and this minimum)
# found the real call still running (see ``_Pending.late``).
_LATE_FRACTION = 0.1
_LATE_MIN_S = 1e-3


class _Pending:
    """The transfer of one async call: its kind, modelled time and booking on the link."""

    __slots__ = (
        "kind",
        "seconds",
        "booking",
        "deadline",
        "settled",
        "works",
        "watch",
        "key",
        "sequence",
    )

    def __init__(self, kind: str, seconds: float, booking: Booking | None) -> None:
        """``booking``: the transfer on the rank's link (None: a stamped receive, booked on
        arrival)."""
        self.kind, self.seconds, self.booking = kind, seconds, booking
        self.deadline = -math.inf if booking is None else booking.completion
        self.settled = False
        self.works: tuple[Any, ...] = ()
        self.watch: Stamp | None = None  # set for a watched p2p call
        self.key: Any = None  # its connection and direction
        self.sequence = 0  # its place in issue order

    def all_done(self) -> bool:
        """Whether every real work of the call reports completion (gloo's send and recv works
        never do before ``wait()``; a work that cannot tell is taken as done)."""
        return all(getattr(work, "is_completed", lambda: True)() for work in self.works)

    def late(self, blocked: float) -> bool:
        """Whether a real ``wait()`` that blocked ``blocked`` s shows the call was still
        running: longer than a tenth of the transfer's time (and 1 ms, above scheduling noise).
        A peer that arrived within that margin is missed: the model is off by at most it."""
        return blocked > max(_LATE_MIN_S, _LATE_FRACTION * self.seconds)

    def settle(self, now: float, *, late: bool) -> float:
        """The completion time, fixed at the first wait: the booking's (later transfers that
        went ahead of it may have moved it since issue); but when the real call was still
        running at that wait (``late``: a peer was late, or the bytes were), the transfer could
        not have run since issue, so it completes ``seconds`` after ``now`` at the earliest, as
        a synchronous call would."""
        if not self.settled:
            self.settled = True
            assert self.booking is not None  # only stamped receives have none
            self.deadline = self.booking.completion
            if late:
                self.deadline = max(self.deadline, now + self.seconds)
        return self.deadline

    def settle_moved(self, order: StreamOrder, arrivals: ArrivalLink, moved_at: float) -> float:
        """The completion time of a watched call whose real data moved at ``moved_at``, fixed
        at the first wait. A receive: its booking on ``arrivals`` from that moment. A send:
        not before its booking, nor before its data moved plus its modelled time behind the
        previous message of its connection (``StreamOrder``)."""
        if not self.settled:
            self.settled = True
            if self.booking is None:
                assert self.watch is not None and self.watch.booking is not None
                self.deadline = arrivals.completion(self.watch.booking)
            else:
                booked = self.booking.completion
                self.deadline = order.completion(
                    self.key, self.sequence, moved_at, self.seconds, booked
                )
        return self.deadline


class _WorkProxy:
    """Stands in for a torch.distributed Work: ``wait()`` is timed and sleeps what remains of
    the modelled transfer, all else forwards to the real work."""

    __slots__ = ("_owner", "_work", "_pending")

    def __init__(self, owner: CollectiveInterceptor, work: Any, pending: _Pending) -> None:
        self._owner, self._work, self._pending = owner, work, pending

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._owner._wait(self._work, self._pending, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
