"""LinkTimeline: FIFO per direction of a full-duplex link, against hand-computed times."""

from __future__ import annotations

import pytest

from colossal_hetero.emulation.link_timeline import LinkTimeline

# Durations are multiples of 1/8 s, exact in binary, so completion times compare exactly.


def test_a_lone_transfer_completes_its_time_after_issue() -> None:
    link = LinkTimeline()
    assert link.book(1.0, egress=0.5) == 1.5
    assert link.book(3.0, ingress=0.25) == 3.25  # an idle link: no queueing


def test_concurrent_transfers_on_one_direction_complete_at_the_sum() -> None:
    link = LinkTimeline()
    assert link.book(0.0, egress=0.375) == 0.375
    assert link.book(0.0, egress=0.125) == 0.5  # waits behind the first: 0.375 + 0.125
    assert link.book(0.25, egress=0.25) == 0.75  # issued while the second is queued
    assert link.book(2.0, egress=0.125) == 2.125  # the queue drained by then


def test_directions_are_independent_and_a_two_way_transfer_waits_for_both() -> None:
    link = LinkTimeline()
    assert link.book(0.0, egress=0.375) == 0.375
    assert link.book(0.0, ingress=0.125) == 0.125  # a receive overlaps the send
    # A collective sends and receives: it starts when both directions are free (0.375).
    assert link.book(0.0, egress=0.25, ingress=0.25) == 0.625
    assert (link.egress_busy_until, link.ingress_busy_until) == (0.625, 0.625)
    # Asymmetric: each direction is busy for its own time, completion is the longer one.
    assert link.book(1.0, egress=0.125, ingress=0.5) == 1.5
    assert (link.egress_busy_until, link.ingress_busy_until) == (1.125, 1.5)
    assert link.book(1.0, egress=0.125) == 1.25  # egress freed at 1.125, not at 1.5


def test_a_free_transfer_neither_queues_nor_occupies() -> None:
    link = LinkTimeline()
    link.book(0.0, egress=1.0, ingress=1.0)
    assert link.book(0.5) == 0.5  # nothing modelled: completes at issue
    assert (link.egress_busy_until, link.ingress_busy_until) == (1.0, 1.0)


def test_negative_durations_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        LinkTimeline().book(0.0, egress=-0.1)
