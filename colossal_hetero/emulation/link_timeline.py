"""One rank's network link as a timeline: when does a transfer issued at ``t`` complete?

Pure: no clocks, no torch. Times are seconds on any one monotonic clock; durations are the
network model's times for each transfer.

Semantics, first-in first-out on a full-duplex link. The link has two directions, egress
(what the rank sends) and ingress (what it receives), each carrying one transfer at a time in
the order transfers were booked. A transfer uses one or both directions for its own duration
in each. It starts when it is issued and every direction it uses is free, holds each of them
for its duration there, and completes when the longer of the two ends::

    start      = max(issue, busy_until[d] for each direction d it uses)
    busy_until[d] = start + seconds[d]
    completion = start + max(seconds[d])

So two transfers issued together on one direction complete at the first's time and at the
sum of both (the second waits behind the first), and a send overlaps a receive. FIFO rather
than fair sharing because a link, and the one gloo connection per peer pair, drains bytes in
the order they were queued: a small transfer queued behind a large one waits for it, which is
the head-of-line blocking that chunking and prioritising collectives avoid. A transfer of zero
seconds (nothing modelled) uses no direction and completes at its issue time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class LinkTimeline:
    """When each direction of one rank's link is next free; ``book`` advances it."""

    egress_busy_until: float = -math.inf
    """End of the last transfer booked on the sending direction."""

    ingress_busy_until: float = -math.inf
    """End of the last transfer booked on the receiving direction."""

    def book(self, issue: float, egress: float = 0.0, ingress: float = 0.0) -> float:
        """Book a transfer issued at ``issue`` that needs ``egress`` seconds of sending and
        ``ingress`` seconds of receiving; returns its completion time (>= ``issue``).

        Raises ValueError for a negative duration (an internal error: model times are >= 0).
        """
        if egress < 0 or ingress < 0:
            raise ValueError(f"transfer durations must be >= 0, got {egress} and {ingress}")
        start = issue
        if egress > 0:
            start = max(start, self.egress_busy_until)
        if ingress > 0:
            start = max(start, self.ingress_busy_until)
        if egress > 0:
            self.egress_busy_until = start + egress
        if ingress > 0:
            self.ingress_busy_until = start + ingress
        return start + max(egress, ingress)
