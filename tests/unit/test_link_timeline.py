"""LinkTimeline: a bounded queue wait, then processor sharing among streams (each stream FIFO)
on each direction of a full-duplex link, against hand-computed completions. Durations are
multiples of 1/8 s and at most two streams share at once where times compare exactly (halves
of dyadic numbers are exact in binary); the three-way case says its tolerance."""

from __future__ import annotations

import math

import pytest

from colossal_hetero.emulation.link_timeline import LinkTimeline


def test_a_lone_transfer_completes_its_time_after_issue() -> None:
    link = LinkTimeline()
    assert link.book(1.0, egress=0.5).completion == 1.5
    assert link.book(3.0, ingress=0.25).completion == 3.25  # an idle link: no queueing


def test_one_stream_is_fifo_whatever_the_queue() -> None:
    for queue in (math.inf, 0.125, 0.0):
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


def test_another_stream_waits_for_the_queue_then_shares_the_rate() -> None:
    link = LinkTimeline(queue=0.25)
    bulk = link.book(0.0, egress=1.0, stream="a")
    small = link.book(0.125, egress=0.125, stream="b")  # 0.875 s booked ahead, queue 0.25 s
    # Starts at 0.375; two streams at half the rate each: its 0.125 s take 0.25 s.
    assert small.completion == 0.125 + 0.25 + 2 * 0.125
    # The bulk moved 0.375 s alone, 0.125 s while shared, then its last 0.5 s alone.
    assert bulk.completion == 0.625 + 0.5 == 1.125 == link.busy_until[0]


def test_a_stream_keeps_its_order_while_sharing() -> None:
    link = LinkTimeline(queue=0.25)
    bulk = link.book(0.0, egress=1.0, stream="a")
    small = link.book(0.125, egress=0.125, stream="b")
    # Issued at 0.25 on the bulk's stream: it waits for the bulk (now ending at 1.125).
    after = link.book(0.25, egress=0.125, stream="a")
    assert (bulk.completion, small.completion, after.completion) == (1.125, 0.625, 1.25)
    # A backlog shorter than the queue is waited out in full, then it runs alone.
    link.book(2.0, egress=0.125, stream="a")
    assert link.book(2.0, egress=0.5, stream="b").completion == 2.625
    assert link.busy_until == [2.625, -math.inf]


def test_two_streams_together_take_the_sum_of_their_times() -> None:
    link = LinkTimeline(queue=0.125)
    first = link.book(0.0, egress=0.5, stream="a")
    second = link.book(0.0, egress=0.375, stream="b")
    # first alone to 0.125 (0.375 left), then both at half: each needs 0.75 s more.
    assert second.completion == first.completion == 0.5 + 0.375 == link.busy_until[0]
    third = LinkTimeline(queue=0.0)
    a = third.book(0.0, egress=0.25, stream="a")
    b = third.book(0.0, egress=0.5, stream="b")
    assert (a.completion, b.completion) == (0.5, 0.75)  # shared to 0.5, then b alone


def test_three_streams_share_in_thirds() -> None:
    link = LinkTimeline(queue=0.0)
    a = link.book(0.0, egress=0.25, stream="a")
    b = link.book(0.0, egress=0.5, stream="b")
    c = link.book(0.0, egress=0.5, stream="c")
    # Thirds until a is done (0.75), then halves for b's and c's 0.25 s left (0.5 s more).
    # Tolerance: (0.75 - 0) / 3 is rounded once, an error of ~1e-16 s.
    assert a.completion == 0.75
    assert b.completion == pytest.approx(1.25, abs=1e-12)
    assert c.completion == pytest.approx(1.25, abs=1e-12) and link.busy_until[0] == 1.25


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


def test_sharing_slows_only_the_directions_it_uses() -> None:
    link = LinkTimeline(queue=0.0)
    both = link.book(0.0, egress=1.0, ingress=0.5, stream="a")
    link.book(0.0, ingress=0.25, stream="b")  # shares the ingress half only
    assert both.ends == [1.0, 0.75] and both.completion == 1.0
    small = link.book(0.0, egress=0.125, stream="c")
    assert small.completion == 0.25 and both.completion == 1.125


def test_a_free_transfer_neither_queues_nor_occupies() -> None:
    link = LinkTimeline()
    link.book(0.0, egress=1.0, ingress=1.0)
    assert link.book(0.5).completion == 0.5  # nothing modelled: completes at issue
    assert link.busy_until == [1.0, 1.0] and [len(lane) for lane in link.lanes] == [1, 1]


def test_completed_bookings_are_dropped_and_keep_their_times() -> None:
    link = LinkTimeline(queue=0.0)
    old = link.book(0.0, egress=0.25, stream="a")
    link.book(1.0, egress=0.25, stream="b")  # after `old` completed: cannot delay it
    assert old.completion == 0.25 and len(link.lanes[0]) == 1


def test_negative_durations_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        LinkTimeline().book(0.0, egress=-0.125)


def test_rendezvous_notice_waits_behind_the_reverse_direction() -> None:
    # Measured on shaped links: a small p2p whose receiver's ready notice queued behind a bulk
    # flow the other way took ~16 ms more than with the receive posted earlier.
    reverse_only = LinkTimeline(queue=0.25, rendezvous=True)
    reverse_only.book(0.0, ingress=1.0, stream="bulk")  # the bulk flows into this rank
    sent = reverse_only.book(0.125, egress=0.125, stream="p2p")
    # notice on the ingress: min(0.875, 0.25); the egress is idle: data starts at 0.375
    assert (sent.start, sent.completion) == (0.375, 0.5)
    plain = LinkTimeline(queue=0.25)
    plain.book(0.0, ingress=1.0, stream="bulk")
    assert plain.book(0.125, egress=0.125, stream="p2p").completion == 0.25  # no notice


def test_rendezvous_behind_a_two_way_bulk_pays_two_queue_waits() -> None:
    link = LinkTimeline(queue=0.25, rendezvous=True)
    link.book(0.0, egress=1.0, ingress=1.0, stream="bulk")  # a ring all-reduce, both ways
    small = link.book(0.125, egress=0.125, ingress=0.125, stream="a2a")
    # each direction: notice 0.25 on the other, then min(0.875 - 0.25, 0.25) = 0.25 of data
    # queue: starts at 0.625, then shares with the bulk at half rate: 0.25 s for 0.125 s
    assert (small.start, small.completion) == (0.625, 0.875)
    idle = LinkTimeline(queue=0.25, rendezvous=True)
    assert idle.book(0.0, egress=0.5).completion == 0.5  # an idle reverse: the notice is free
