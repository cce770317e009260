"""One rank's network link as a timeline: when does a transfer issued at ``t`` complete?

Pure: no clocks, no torch. Times are seconds on any one monotonic clock; durations are the
network model's times for each transfer.

Semantics: a full-duplex link whose two directions, egress (what the rank sends) and ingress
(what it receives), each drain a first-in first-out queue holding at most ``queue`` seconds
of traffic, as a switch port's buffer does. Transfers travel on streams (one connection, e.g.
one process group's sockets), and a stream delivers its bytes in order. A transfer uses one or
both directions, for its own duration on each:

- it waits for the earlier transfers of its own stream, and behind other streams' traffic for
  at most ``queue`` seconds:
  ``start = issue + max over its directions d of max(min(backlog[d], queue), own[d])``, where
  ``backlog[d]`` is how long ``d`` stays busy after ``issue`` and ``own[d]`` how long the
  stream's own earlier transfers still run on it;
- it then holds each direction for its duration there and completes when the longer ends:
  ``completion = start + max(seconds[d])``;
- the link conserves work: a transfer that starts ahead of other streams' remaining bytes
  delays every booked transfer still running on that direction by its own duration there, so
  the direction is busy for the same total.

So two transfers of one stream issued together complete at the first's time and at the sum of
both (FIFO); on two streams, the second waits for the queue (or for the first, if shorter),
and the first then ends that much later; either way the two together take the sum of their
times. With ``queue = inf`` every stream is FIFO behind all traffic. Why bounded: a bulk TCP
transfer through a shaper keeps the shaper's queue full, not its whole payload queued (the
rest waits in the sender's socket), so another connection's bytes wait behind the queue's
backlog only. A transfer of zero seconds (nothing modelled) uses no direction and completes at
its issue time.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

EGRESS, INGRESS = 0, 1
"""Indices of the two directions in ``Booking.ends`` and ``LinkTimeline.busy_until``."""


@dataclass(slots=True)
class Booking:
    """One booked transfer. Its ends move later when another stream's transfer, booked after
    it, starts ahead of its remaining bytes (work conservation)."""

    stream: Hashable
    """The connection it travels on."""

    start: float
    """When its bytes start to move (after waiting behind the queue)."""

    ends: list[float] = field(default_factory=lambda: [-math.inf, -math.inf])
    """When it stops using each direction (``EGRESS``, ``INGRESS``); -inf if it does not."""

    @property
    def completion(self) -> float:
        """When the transfer completes: its later end (its start if it uses no direction)."""
        return max(self.start, *self.ends)


@dataclass(slots=True)
class LinkTimeline:
    """The bookings of one rank's link; ``book`` adds one and returns it."""

    queue: float = math.inf
    """Seconds of traffic a direction's queue holds: the longest a transfer waits behind
    other streams (inf: FIFO behind everything)."""

    busy_until: list[float] = field(default_factory=lambda: [-math.inf, -math.inf])
    """When each direction drains everything booked on it."""

    running: list[Booking] = field(default_factory=list)
    """Bookings not complete at the last issue, which later ones may still delay (issues come
    in clock order, so a booking complete then stays complete)."""

    def book(
        self, issue: float, egress: float = 0.0, ingress: float = 0.0, stream: Hashable = None
    ) -> Booking:
        """Book a transfer on ``stream`` issued at ``issue`` needing ``egress`` seconds of
        sending and ``ingress`` seconds of receiving; returns its booking
        (``completion >= issue``).

        Raises ValueError for a negative duration (an internal error: model times are >= 0).
        """
        seconds = (egress, ingress)
        if min(seconds) < 0 or self.queue < 0:
            raise ValueError(f"durations must be >= 0, got {egress}, {ingress}, {self.queue}")
        used = [d for d in (EGRESS, INGRESS) if seconds[d] > 0]
        self.running = [b for b in self.running if b.completion > issue]
        start = issue
        for d in used:
            queued = min(max(0.0, self.busy_until[d] - issue), self.queue)
            own = max((b.ends[d] for b in self.running if b.stream == stream), default=issue)
            start = max(start, issue + queued, own)
        booking = Booking(stream, start)
        for d in used:
            for other in self.running:  # it goes ahead of their remaining bytes: delay them
                if other.stream != stream and other.ends[d] > start:
                    other.ends[d] += seconds[d]
            self.busy_until[d] = max(self.busy_until[d], start) + seconds[d]
            booking.ends[d] = start + seconds[d]
        if used:
            self.running.append(booking)
        return booking
