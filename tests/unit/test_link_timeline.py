"""LinkTimeline: per-stream FIFO behind a bounded queue on each direction of a full-duplex
link, against hand-computed completions. Durations are multiples of 1/8 s (exact in binary),
so times compare exactly."""

from __future__ import annotations

import math

import pytest

from colossal_hetero.emulation.link_timeline import LinkTimeline


def test_a_lone_transfer_completes_its_time_after_issue() -> None:
    link = LinkTimeline()
    assert link.book(1.0, egress=0.5).completion == 1.5
    assert link.book(3.0, ingress=0.25).completion == 3.25  # an idle link: no queueing


def test_one_stream_is_fifo_whatever_the_queue() -> None:
    for queue in (math.inf, 0.125):
        link = LinkTimeline(queue)
        first = link.book(0.0, egress=0.375)
        second = link.book(0.0, egress=0.125)  # waits for the first: ends at the sum
        third = link.book(0.25, egress=0.25)  # issued while the second is queued
        late = link.book(2.0, egress=0.125)  # the stream drained by then
        assert [b.completion for b in (first, second, third, late)] == [0.375, 0.5, 0.75, 2.125]


def test_an_unbounded_queue_makes_every_stream_wait_for_everything() -> None:
    link = LinkTimeline()
    bulk = link.book(0.0, egress=1.0, stream="a")
    small = link.book(0.125, egress=0.125, stream="b")
    assert (bulk.completion, small.completion) == (1.0, 1.125)


def test_another_stream_waits_for_the_queue_and_delays_the_bulk() -> None:
    link = LinkTimeline(queue=0.25)
    bulk = link.book(0.0, egress=1.0, stream="a")
    small = link.book(0.125, egress=0.125, stream="b")  # 0.875 s booked ahead, queue 0.25 s
    assert small.completion == 0.125 + 0.25 + 0.125
    assert bulk.completion == 1.125  # the link did the small transfer's bytes first
    # The bulk's stream stays in order: its next transfer follows the delayed bulk.
    assert link.book(0.25, egress=0.125, stream="a").completion == 1.25
    # A backlog shorter than the queue is waited out in full.
    link.book(2.0, egress=0.125, stream="a")
    assert link.book(2.0, egress=0.5, stream="b").completion == 2.625
    assert link.busy_until == [2.625, -math.inf]


def test_two_streams_together_take_the_sum_of_their_times() -> None:
    link = LinkTimeline(queue=0.125)
    first = link.book(0.0, egress=0.5, stream="a")
    second = link.book(0.0, egress=0.375, stream="b")
    assert second.completion == 0.125 + 0.375  # behind the queue only
    assert first.completion == 0.5 + 0.375 == link.busy_until[0]


def test_directions_are_independent_and_a_two_way_transfer_waits_for_both() -> None:
    link = LinkTimeline()
    assert link.book(0.0, egress=0.375).completion == 0.375
    assert link.book(0.0, ingress=0.125).completion == 0.125  # a receive overlaps the send
    # A collective sends and receives: it starts when both directions are free (0.375).
    assert link.book(0.0, egress=0.25, ingress=0.25).completion == 0.625
    assert link.busy_until == [0.625, 0.625]
    # Asymmetric: each direction is busy for its own time, completion is the longer one.
    assert link.book(1.0, egress=0.125, ingress=0.5).completion == 1.5
    assert link.busy_until == [1.125, 1.5]
    assert link.book(1.0, egress=0.125).completion == 1.25  # egress freed at 1.125, not 1.5


def test_a_cut_in_delays_only_the_directions_it_uses() -> None:
    link = LinkTimeline(queue=0.0)
    both = link.book(0.0, egress=1.0, ingress=0.5, stream="a")
    link.book(0.0, ingress=0.25, stream="b")  # ahead of the ingress half only
    assert both.ends == [1.0, 0.75] and both.completion == 1.0
    link.book(0.0, egress=0.125, stream="c")
    assert both.completion == 1.125


def test_a_free_transfer_neither_queues_nor_occupies() -> None:
    link = LinkTimeline()
    link.book(0.0, egress=1.0, ingress=1.0)
    assert link.book(0.5).completion == 0.5  # nothing modelled: completes at issue
    assert link.busy_until == [1.0, 1.0] and len(link.running) == 1


def test_completed_bookings_are_dropped_and_keep_their_times() -> None:
    link = LinkTimeline(queue=0.0)
    old = link.book(0.0, egress=0.25, stream="a")
    link.book(1.0, egress=0.25, stream="b")  # after `old` completed: cannot delay it
    assert old.completion == 0.25 and len(link.running) == 1


def test_negative_durations_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        LinkTimeline().book(0.0, egress=-0.125)
