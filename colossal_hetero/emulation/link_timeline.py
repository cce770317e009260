"""One rank's network link as a timeline: when does a transfer issued at ``t`` complete?

Pure: no clocks, no torch. Times are seconds on any one monotonic clock; durations are the
network model's times for each transfer (its bytes at the link's full rate).

Semantics: a full-duplex link whose two directions, egress (what the rank sends) and ingress
(what it receives), are each a server shared by the transfers on it. Transfers travel on
streams (one connection, e.g. one process group's sockets), and a stream delivers its bytes in
order. A transfer uses one or both directions, for its own duration of work on each:

- it waits behind the traffic already on the link for at most ``queue`` seconds, as behind a
  switch port's buffer:
  ``start = issue + max over its directions d of min(backlog[d], queue)``, where
  ``backlog[d]`` is how long ``d`` stays busy after ``issue``;
- with ``rendezvous``, the data on ``d`` waits first for the receiver's ready notice, a small
  message that crosses the other direction ``d'`` behind its queue:
  ``start = issue + max over d of (n_d + min(backlog[d] after n_d, queue))`` with
  ``n_d = min(backlog[d'], queue)``. On an idle reverse direction the notice is free; behind a
  bulk transfer both ways (a ring all-reduce) a transfer pays two queue waits;
- from ``start`` it is served on each direction once its stream's earlier transfers there
  are done (a stream is first-in first-out);
- a direction shares its rate equally among the streams it is serving (processor sharing, as
  TCP connections through one bottleneck share it): ``k`` streams served at once each move at
  ``1/k`` of the rate, so a transfer of ``s`` seconds alone takes ``k s`` while they overlap;
- it completes when its last direction is done.

The link conserves work: a direction is busy while anything is served on it, for the sum of
the durations booked on it. So two transfers issued together take the sum of their times: on
one stream the second completes at the sum (FIFO); on two streams the second waits for the
queue (or for the first, if shorter), then both share the link and the later of the two
completes at the sum. With ``queue = inf`` a transfer waits for everything booked before it.
Why a bounded wait and then sharing: a bulk TCP transfer through a shaper keeps the shaper's
queue full, not its whole payload queued (the rest waits in the sender's socket), so another
connection's first bytes wait behind the queue's backlog; after that both connections have
bytes in the queue and the shaper serves them in turn. A transfer of zero seconds (nothing
modelled) uses no direction and completes at its issue time. Booking a transfer never moves
an earlier one's completion earlier; it may move it later.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

EGRESS, INGRESS = 0, 1
"""Indices of the two directions in ``Booking.ends`` and ``LinkTimeline.busy_until``."""


@dataclass(slots=True)
class Booking:
    """One booked transfer. Its ends move later when transfers booked after it share a
    direction with it."""

    stream: Hashable
    """The connection it travels on."""

    start: float
    """When it may start to move bytes (after waiting behind the queue)."""

    ends: list[float] = field(default_factory=lambda: [-math.inf, -math.inf])
    """When it stops using each direction (``EGRESS``, ``INGRESS``); -inf if it does not."""

    @property
    def completion(self) -> float:
        """When the transfer completes: its later end (its start if it uses no direction)."""
        return max(self.start, *self.ends)


@dataclass(slots=True)
class _Share:
    """A booking's use of one direction: seconds of full-rate work still to do."""

    booking: Booking
    remaining: float


@dataclass(slots=True)
class LinkTimeline:
    """The bookings of one rank's link; ``book`` adds one and returns it."""

    queue: float = math.inf
    """Seconds of traffic a direction's queue holds: the longest a transfer waits behind
    traffic booked before it (inf: behind everything)."""

    rendezvous: bool = False
    """Data moves only after the receiver's ready notice arrived (gloo's and NCCL's transports
    send a transfer once the receiver has posted its buffer): the notice crosses the other
    direction first, behind that direction's queue."""

    busy_until: list[float] = field(default_factory=lambda: [-math.inf, -math.inf])
    """When each direction drains everything booked on it."""

    lanes: list[list[_Share]] = field(default_factory=lambda: [[], []])
    """Per direction, the shares not done at ``served_to``, in booking order."""

    served_to: float = -math.inf
    """The time up to which ``lanes`` has been served (the last issue)."""

    def book(
        self,
        issue: float,
        egress: float = 0.0,
        ingress: float = 0.0,
        stream: Hashable = None,
        rendezvous: bool | None = None,
    ) -> Booking:
        """Book a transfer on ``stream`` issued at ``issue`` (not before the previous issue)
        needing ``egress`` seconds of sending and ``ingress`` seconds of receiving; returns its
        booking (``completion >= issue``), whose ends later bookings may move later.
        ``rendezvous`` overrides the link's for this transfer (False: its receiver's notice is
        known to be there already).

        Raises ValueError for a negative duration (an internal error: model times are >= 0).
        """
        seconds = (egress, ingress)
        if min(seconds) < 0 or self.queue < 0:
            raise ValueError(f"durations must be >= 0, got {egress}, {ingress}, {self.queue}")
        assert issue >= self.served_to, "transfers are booked in clock order"
        used = [d for d in (EGRESS, INGRESS) if seconds[d] > 0]
        for d in (EGRESS, INGRESS):  # what was served until now stays as it was
            self.lanes[d] = _serve(self.lanes[d], d, self.served_to, issue)
        self.served_to = issue
        notice = self.rendezvous if rendezvous is None else rendezvous
        waits = (self._wait(d, issue, notice) for d in used)
        booking = Booking(stream, issue + max(waits, default=0.0))
        for d in used:
            self.busy_until[d] = max(self.busy_until[d], booking.start) + seconds[d]
            self.lanes[d].append(_Share(booking, seconds[d]))
            # Project every share's end from now: the new one may slow those it overlaps.
            _serve([_Share(s.booking, s.remaining) for s in self.lanes[d]], d, issue, math.inf)
        return booking

    def _wait(self, d: int, issue: float, rendezvous: bool) -> float:
        """Seconds from ``issue`` until data on direction ``d`` may move: the receiver's ready
        notice behind the other direction's queue (with ``rendezvous``), then ``d``'s queue."""
        notice = self._queued(1 - d, issue) if rendezvous else 0.0
        return notice + self._queued(d, issue + notice)

    def _queued(self, d: int, t: float) -> float:
        """How long something sent on ``d`` at ``t`` waits behind the queue there."""
        return min(max(0.0, self.busy_until[d] - t), self.queue)


@dataclass(slots=True)
class LinkClasses:
    """One rank's link as its classes (``NetworkModel.link_class``: a listed peer's, None for
    the default), a :class:`LinkTimeline` each, made on first use with this queue and
    rendezvous."""

    queue: float = math.inf
    rendezvous: bool = False
    timelines: dict[int | None, LinkTimeline] = field(default_factory=dict)

    def timeline(self, link_class: int | None) -> LinkTimeline:
        """The timeline of ``link_class``."""
        timeline = self.timelines.get(link_class)
        if timeline is None:
            timeline = self.timelines[link_class] = LinkTimeline(self.queue, self.rendezvous)
        return timeline


def _serve(lane: list[_Share], d: int, now: float, until: float) -> list[_Share]:
    """Serve ``lane`` (direction ``d``'s shares, in booking order) from ``now`` to ``until``:
    each stream's first unfinished share is served once its booking has started, all served
    shares at an equal part of the rate. Decreases ``remaining``, sets the booking's end on
    ``d`` for every share finished by ``until``, and returns the unfinished ones."""
    t = now
    while lane and t < until:
        heads: dict[Hashable, _Share] = {}
        for share in lane:
            heads.setdefault(share.booking.stream, share)
        served = [s for s in heads.values() if s.booking.start <= t]
        arrival = min(
            (s.booking.start for s in heads.values() if s.booking.start > t), default=math.inf
        )
        if not served:  # idle until the next stream may start
            t = min(arrival, until)
            continue
        k, least = len(served), min(s.remaining for s in served)
        finish = t + least * k
        step_to = min(finish, arrival, until)
        for share in served:
            if step_to == finish and share.remaining == least:
                share.remaining = 0.0  # exact: no rounding of (finish - t) / k
                share.booking.ends[d] = finish
            else:
                share.remaining -= (step_to - t) / k
                if share.remaining <= 0.0:  # rounding left nothing: it ends here
                    share.booking.ends[d] = step_to
        lane = [s for s in lane if s.remaining > 0.0]
        t = step_to
    return lane
