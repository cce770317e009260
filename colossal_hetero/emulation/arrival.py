"""When a non-blocking point-to-point call's real data moved, for the model's link times.

Model mode books an async call's modelled transfer from when it was issued. For a receive
that is when it was posted, which a schedule that posts its receives early (kFkB posts a
step's at once) reaches long before the matching send: booked from the post, a message could
land sooner after its send than the link takes to carry it. On a host backend (gloo) a real
p2p ``wait()`` blocks until the data is there, so a :class:`CompletionWatch` thread waits on
the real work from when it is issued and stamps the moment it completed: for a receive, the
sender's data arrived (the real loopback takes microseconds); for a send, its data left,
once the receiver had posted (gloo parks a send until the receiver's ready notice). The
modelled transfer then cannot complete before that moment plus its modelled time, nor,
per connection and direction, before the previous message's completion plus its time
(:class:`StreamOrder`, a first-in first-out link).

On accelerator backends a work's ``wait()`` returns at once (it orders streams), so there is
nothing to stamp there and the interceptor keeps its issue-time booking.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable
from typing import Any

from colossal_hetero.emulation.link_timeline import Booking, LinkClasses


class Stamp:
    """One watched work: set once its real ``wait()`` returned (or raised)."""

    __slots__ = ("_done", "_result", "_error", "completed_at", "booking")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self.completed_at = 0.0
        self.booking: Booking | None = None
        """A receive's transfer, booked on the :class:`ArrivalLink` as its data arrived."""

    def join(self) -> tuple[Any, float]:
        """Block until the real work completed; its ``wait()`` result and when it completed.
        Re-raises what the real ``wait()`` raised (a timeout, a peer gone)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result, self.completed_at


class CompletionWatch:
    """Waits on real works in order, one daemon thread per connection (its group, direction,
    peer and tag: gloo matches those first-in first-out), and stamps when each completed.

    The threads live from a connection's first watched work to :meth:`close`, so a work is
    waited on as soon as the earlier ones of its connection are done, with no thread to start
    per message (on a loaded host a new thread took 10-30 ms to reach its wait). A thread
    blocked in ``work.wait()`` or on its queue holds no GIL, so watching costs the rank's
    compute nothing; a stamp is late by the time the thread then waits for the interpreter
    (up to its switch interval while the rank runs Python) and for a core. A stamp's
    :meth:`Stamp.join` is the work's only ``wait()``: gloo's p2p works must be waited once.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._queues: dict[Hashable, queue.SimpleQueue[_Watched | None]] = {}

    def watch(self, connection: Hashable, work: Any, arrival: Arrival | None = None) -> Stamp:
        """Wait on ``work`` after the earlier works of ``connection``; its stamp. ``arrival``
        (a receive's): the link, modelled seconds and link class to book it on once its data
        arrived."""
        waiting = self._queues.get(connection)
        if waiting is None:
            waiting = self._queues[connection] = queue.SimpleQueue()
            threading.Thread(
                target=self._drain, args=(waiting,), name="p2p-completion", daemon=True
            ).start()
        stamp = Stamp()
        waiting.put((work, stamp, connection, arrival))
        return stamp

    def close(self) -> None:
        """Let every thread end once the works already given to it completed."""
        for waiting in self._queues.values():
            waiting.put(None)
        self._queues = {}

    def _drain(self, waiting: queue.SimpleQueue[_Watched | None]) -> None:
        while (item := waiting.get()) is not None:
            work, stamp, connection, arrival = item
            try:
                stamp._result = work.wait()
                stamp.completed_at = self._clock()
                if arrival is not None:
                    link, seconds, link_class = arrival
                    stamp.booking = link.book(stamp.completed_at, seconds, connection, link_class)
            except BaseException as error:  # handed to the caller of Stamp.join, never lost
                stamp._error = error
            stamp._done.set()


class ArrivalLink:
    """The receiving direction of this rank's link for stamped receives, booked as their data
    arrives: the watching threads book each receive at its stamp (under a lock, so in clock
    order), on its connection's stream, on its class of the link (one timeline per class, as
    the interceptor keeps: ``NetworkModel.link_class``). A receive posted early thus holds no
    link time before its sender's data comes (booked from its post, kFkB's 16 early receives
    kept a preempted middle stage's link busy for 0.66 s of phantom transfers, and a gradient
    behind them landed 0.5 s late), while receives whose data arrive together share the
    direction, each connection in order. Sends and other calls stay on the interceptor's own
    timelines: the two directions of a full-duplex link do not share a rate."""

    def __init__(self, queue_s: float) -> None:
        self._links = LinkClasses(queue_s)
        self._lock = threading.Lock()

    def book(
        self, arrived: float, seconds: float, stream: Hashable, link_class: int | None = None
    ) -> Booking:
        """Book ``seconds`` of receiving on class ``link_class`` from ``arrived`` (or the
        class's latest booking, which another thread's stamp may have just passed by
        microseconds)."""
        with self._lock:
            link = self._links.timeline(link_class)
            issue = max(arrived, link.served_to)
            return link.book(issue, ingress=seconds, stream=stream, rendezvous=False)

    def completion(self, booking: Booking) -> float:
        """``booking``'s completion now (later bookings sharing the direction move it)."""
        with self._lock:
            return booking.completion


Arrival = tuple[ArrivalLink, float, "int | None"]
"""Where a watched receive books once its data arrived: the link, its modelled seconds and
its class of the link."""
_Watched = tuple[Any, Stamp, Hashable, "Arrival | None"]


class StreamOrder:
    """Per connection and direction, the last settled message: a link delivers one
    connection's messages in order, each after the one before it."""

    __slots__ = ("_issued", "_last")

    def __init__(self) -> None:
        self._issued = 0
        self._last: dict[Hashable, tuple[int, float]] = {}  # key -> (sequence, completion)

    def issue(self) -> int:
        """A sequence number for a message just issued (issue order)."""
        self._issued += 1
        return self._issued

    def completion(
        self, key: Hashable, sequence: int, moved_at: float, seconds: float, booked: float
    ) -> float:
        """When message ``sequence`` on ``key`` completes: not before its booking
        (``booked``), nor ``seconds`` after its real data moved (``moved_at``) or after the
        previous message of ``key`` completed, whichever is later. Settling messages out of
        issue order only loses the ordering term for the earlier one."""
        last = self._last.get(key)
        start = moved_at
        if last is not None and last[0] < sequence:
            start = max(start, last[1])
        done = max(booked, start + seconds)
        if last is None or last[0] < sequence:
            self._last[key] = (sequence, done)
        return done
