"""pipeline/profile.py: link time from per-message timestamps, the profile of a measured step,
and the simulator's prediction of it.

Oracles: hand-computed timestamps, and the simulator itself: a simulated step is turned into
the records its ranks would have measured (a sender notes when each pass ended, a receiver when
it asked for each input and the arrival of each one it had to wait for), and the profile read
back from those records must give the link times the step was simulated with, and predict the
same step time.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import random

import pytest

from colossal_hetero.pipeline.profile import (
    NOT_BLOCKED,
    RankRecord,
    link_seconds,
    predict_from_records,
    profile_from_records,
    record_from_vector,
    vector_width,
)
from colossal_hetero.pipeline.simulator import Trace, simulate
from colossal_hetero.pipeline.tuner import simulate_profile


def _pair(sent, posted, arrived, asked, up=None):
    """Records of a two-stage step whose activations had these timestamps (``up``: the same
    four lists for its gradients, else none)."""
    sent_prev, posted_next, arrived_next, asked_next = up or ((), (), (), ())
    first = RankRecord(0, 0, 1, 1.0, 1.0, 9.0, 8.0, 4.0, tuple(sent),
                       posted_next=tuple(posted_next), arrived_next=tuple(arrived_next),
                       asked_next=tuple(asked_next))  # fmt: skip
    second = RankRecord(1, 1, None, 1.0, 1.0, 9.0, 8.0, 0.0, arrived_prev=tuple(arrived),
                        posted_prev=tuple(posted), sent_prev=tuple(sent_prev),
                        asked_prev=tuple(asked))  # fmt: skip
    return [first, second]


def test_link_seconds_by_hand():
    nb = NOT_BLOCKED
    # The first message, asked for at 0.0 and sent at 0.1, arrives at 0.5: 0.4 s (its metadata
    # exchange and transfer). Three more, sent at 0.1-0.3 with receives posted at 0.45 once the
    # metadata was read: the first two land unseen, the third at 1.1. All three moved after the
    # first landed (0.5), one at a time: 0.6 s / 3 = 0.2 s each (every other bound is larger).
    # Its receiver asked at 0.9: it waited 0.2 s, at least half of 0.2 s.
    sent, posted = [0.1, 0.1, 0.2, 0.3], [0.0, 0.45, 0.45, 0.45]
    links = link_seconds(_pair(sent, posted, [0.5, nb, nb, 1.1], [0.0, 0.6, 0.7, 0.9]), 2)
    assert links["F0"] == (pytest.approx(0.4),) and links["F"] == (pytest.approx(0.2),)
    # Gradients: the first sent at 2.0, asked for at 1.8, lands 2.3 (0.3 s); the second,
    # sent 2.1, posted 2.25, asked for at 3.0, "arrives" at 3.001: a wait of 1 ms at the end of
    # a 0.7 s interval is the receiver descheduled, not the link: no sample, the link is free.
    up = ([2.0, 2.1], [1.9, 2.25], [2.3, 3.001], [1.8, 3.0])
    links = link_seconds(_pair(sent, posted, [0.5, nb, nb, 1.1], [0.0, 0.6, 0.7, 0.9], up), 2)
    assert links["B0"] == (pytest.approx(0.3),) and links["B"] == (0.0,)
    assert links["F"] == (pytest.approx(0.2),)
    # Without the times asked (older records) every blocked wait counts: 3.001 - 2.3 = 0.701.
    old = [RankRecord.from_dict({**r.to_dict(), "asked_prev": [], "asked_next": []})
           for r in _pair(sent, posted, [0.5, nb, nb, 1.1], [0.0] * 4, up)]  # fmt: skip
    assert link_seconds(old, 2)["B"] == (pytest.approx(0.701),)
    # Hidden transfers: no wait blocked.
    assert link_seconds(_pair(sent, posted, [nb] * 4, [9.0] * 4), 2)["F"] == (0.0,)


def test_link_seconds_shared_ports_by_hand():
    # Three stages. Stage 1 sends a gradient to stage 0 (sent 1.0, lands 2.0, seen) and then
    # an activation to stage 2 (its second message: sent 1.5, arrives 2.5, asked for at 1.6).
    # Through stage 1's one upload the activation moved only after the gradient landed: 0.5 s.
    # As separate links it moved from 1.5: 1.0 s.
    nb = NOT_BLOCKED
    r0 = RankRecord(0, 0, 1, 1.0, 1.0, 9.0, 8.0, 4.0, (0.0,), posted_next=(0.0,),
                    arrived_next=(2.0,), asked_next=(0.5,))  # fmt: skip
    r1 = RankRecord(1, 1, 2, 1.0, 1.0, 9.0, 8.0, 4.0, (0.2, 1.5), arrived_prev=(nb,),
                    posted_prev=(0.0,), sent_prev=(1.0,), asked_prev=(0.5,))  # fmt: skip
    r2 = RankRecord(2, 2, None, 1.0, 1.0, 9.0, 8.0, 0.0, arrived_prev=(0.3, 2.5),
                    posted_prev=(0.0, 0.0), asked_prev=(0.0, 1.6))  # fmt: skip
    assert link_seconds([r0, r1, r2], 3)["F"] == (0.0, pytest.approx(0.5))
    assert link_seconds([r0, r1, r2], 3, shared_ports=False)["F"] == (0.0, pytest.approx(1.0))
    assert link_seconds([r2, r0, r1], 3) == link_seconds([r0, r1, r2], 3)


def test_token_debt_by_hand():
    # tc htb lets a message through while its bucket is not empty and charges it after: a lone
    # message lands at once, a queued one a transfer time (1.0 s) after the one before it.
    # Activations: the first, sent and asked for at 0, lands 0.5. Two lone ones sent (and asked
    # for) at 1.0 and 2.0 land 0.1 s later: samples 0.1, "alone" (own release, no landing
    # after it). Two more sent at 2.05 and 2.5, asked for at 2.2 and 3.1, land 3.0 and 4.0:
    # each moved after the landing before it, 0.9 and 1.0 s later ("queued").
    nb = NOT_BLOCKED
    sent, posted = [0.0, 1.0, 2.0, 2.05, 2.5], [0.0] * 5
    arrived, asked = [0.5, 1.1, 2.1, 3.0, 4.0], [0.0, 1.0, 2.0, 2.2, 3.1]
    links = link_seconds(_pair(sent, posted, arrived, asked), 2)
    # Lone 0.1 < half the queued 0.95: debt. Fewer than 3 queued samples: the step's pooled
    # median 0.95 per message; the lone median 0.1 is the latency, the first message
    # 0.5 - 0.1 = 0.4.
    assert links["D"] == (1.0,)
    assert links["F"] == (pytest.approx(0.95),) and links["LF"] == (pytest.approx(0.1),)
    assert links["F0"] == (pytest.approx(0.4),)
    profile = profile_from_records(_pair(sent, posted, arrived, asked), 2)
    assert profile.token_debt
    # A FIFO link lands a lone message no sooner than a queued one: lone 1.05 s after its send,
    # the queued ones 1.0 s after the landing before them. No debt; the lone sample's excess is
    # latency (1.05 - 1.0 = 0.05, link 1.0).
    fifo = [0.5, 2.05, 3.05, 4.05, 5.05]
    links = link_seconds(_pair(sent, posted, fifo, [0.0, 1.0, 2.0, 3.1, 4.1]), 2)
    assert links["D"] == (0.0,)
    assert links["F"] == (pytest.approx(1.0),) and links["LF"] == (pytest.approx(0.05),)
    assert not profile_from_records(_pair(sent, posted, fifo, asked), 2).token_debt
    assert not profile_from_records(_pair(sent, posted, [0.5, nb, nb, nb, nb], asked), 2).token_debt


def test_first_message_after_a_landing_on_its_port():
    # Three stages, shared ports. Stage 1's first gradient (sent 1.0, asked for at 1.0) lands
    # 3.0 at stage 0. Stage 1's upload carried its first activation to stage 2 before it (sent
    # 0.5, landed 2.5, seen): the gradient queued behind it on that port, and the simulator
    # queues it there too, so its own time is 3.0 - 2.5 = 0.5, not 3.0 - 1.0 = 2.0 (as on
    # separate links).
    r0 = RankRecord(0, 0, 1, 1.0, 1.0, 9.0, 8.0, 4.0, (0.0,), posted_next=(0.0,),
                    arrived_next=(3.0,), asked_next=(1.0,))  # fmt: skip
    r1 = RankRecord(1, 1, 2, 1.0, 1.0, 9.0, 8.0, 4.0, (0.5,), arrived_prev=(0.2,),
                    posted_prev=(0.0,), sent_prev=(1.0,), asked_prev=(0.0,))  # fmt: skip
    r2 = RankRecord(2, 2, None, 1.0, 1.0, 9.0, 8.0, 0.0, arrived_prev=(2.5,),
                    posted_prev=(0.0,), asked_prev=(0.5,))  # fmt: skip
    assert link_seconds([r0, r1, r2], 3)["B0"] == (pytest.approx(0.5), 0.0)
    assert link_seconds([r0, r1, r2], 3, shared_ports=False)["B0"] == (pytest.approx(2.0), 0.0)


def _records_from_simulation(f, b, c, m, k, first, latency=0.0, shared=False, early=False):
    """The records each stage of a simulated step would measure (one rank per stage): a
    sender notes when each pass ended; a receiver asks for each input when it is free for
    that pass, notes the arrival of each one it had to wait for, and posts every receive when
    it asks for the first (no message moves before; the first takes ``first`` seconds).
    ``shared``: the step ran on shared stage ports (else one link per boundary and direction).
    ``early``: the first message's receive was posted at the step's start (``first`` unused)."""
    p = len(f)
    firsts = [first] * (p - 1)
    lat = [latency] * (p - 1)  # after the link, on both directions
    traces = [Trace.constant(x) for x in c]
    result = simulate(
        f, b, traces, m, k, first_s=firsts, latency_s=lat, shared_ports=shared, first_early=early
    )
    sent = {(s, op): [0.0] * m for s in range(p) for op in "FB"}
    arrived = {(s, op): [NOT_BLOCKED] * m for s in range(p) for op in "FB"}
    asked = {(s, op): [0.0] * m for s in range(p) for op in "FB"}
    for s in range(p):
        free = 0.0
        for e in (e for e in result.events if e.stage == s):
            needs_input = (e.op == "F" and s > 0) or (e.op == "B" and s < p - 1)
            asked[(s, e.op)][e.mb] = free
            if needs_input and e.start > free + 1e-12:  # idle until the input landed
                arrived[(s, e.op)][e.mb] = e.start
            sent[(s, e.op)][e.mb] = e.end
            free = e.end
    posted = {(s, op): [asked[(s, op)][0]] * m for s in range(p) for op in "FB"}
    for s, op in posted if early else ():
        posted[(s, op)][0] = -1e-6  # posted as the step started, before it was asked for

    def lists(s, op):
        return tuple(sent[(s, op)]), tuple(posted[(s, op)]), tuple(arrived[(s, op)])

    return [
        RankRecord(
            rank=s,
            stage=s,
            next_rank=s + 1 if s < p - 1 else None,
            forward_s=f[s],
            backward_s=b[s],
            step_s=max(e.end for e in result.events if e.stage == s),  # its own wall time
            activation_bytes=100.0,
            message_bytes=10.0,
            sent_next=tuple(sent[(s, "F")]) if s < p - 1 else (),
            arrived_prev=tuple(arrived[(s, "F")]) if s > 0 else (),
            posted_prev=tuple(posted[(s, "F")]) if s > 0 else (),
            sent_prev=tuple(sent[(s, "B")]) if s > 0 else (),
            arrived_next=tuple(arrived[(s, "B")]) if s < p - 1 else (),
            posted_next=tuple(posted[(s, "B")]) if s < p - 1 else (),
            asked_prev=tuple(asked[(s, "F")]) if s > 0 else (),
            asked_next=tuple(asked[(s, "B")]) if s < p - 1 else (),
            first_early=float(early),
        )  # fmt: skip
        for s in range(p)
    ], result.step_time


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_link_time_and_step_recovered_from_simulated_timestamps(p, m):
    rng = random.Random(p * 100 + m)
    exact = 0
    for _ in range(20):
        f = [rng.uniform(0.5, 1.5) for _ in range(p)]
        b = [2 * x for x in f]
        c = [rng.choice([0.0, rng.uniform(0.1, 3.0)]) for _ in range(p - 1)]
        first = rng.uniform(0.0, 2.0)
        for k in (1, 2, m):
            records, step = _records_from_simulation(f, b, c, m, k, first)
            profile = profile_from_records(records, p, shared_ports=False)
            assert profile.first_transfer_s == pytest.approx([first] * (p - 1), abs=1e-9)
            assert profile.first_transfer_up_s == pytest.approx([first] * (p - 1), abs=1e-9)
            for got, want in zip(profile.transfer_s + profile.transfer_up_s, c + c, strict=True):
                # A transfer hidden behind compute (or waited for too briefly to tell) reads
                # as free; else it reads exactly.
                assert got == pytest.approx(want, abs=1e-9) or got == 0.0, (f, c, k)
                exact += want > 0 and got == pytest.approx(want, abs=1e-9)
    assert exact >= 20  # most slow links were read, not just called free


def test_prediction_of_a_simulated_step_and_record_order():
    rng = random.Random(7)
    for p, m in ((2, 4), (4, 8)):
        f = [rng.uniform(0.5, 1.5) for _ in range(p)]
        b = [2 * x for x in f]
        c = [2.0] * (p - 1)  # slower than every pass: every later message is waited for
        for k in (1, 2, m):
            records, step = _records_from_simulation(f, b, c, m, k, 0.5)
            prediction = predict_from_records(records, m, k)
            if p == 2:  # each port carries one kind of message: the model the step came from
                assert prediction.profile.transfer_s == pytest.approx(c, abs=1e-9)
                assert prediction.predicted_s == pytest.approx(step, rel=1e-9)
            # Any order of the gathered records, and records as JSON dicts, give the same.
            shuffled = [r.to_dict() for r in rng.sample(records, len(records))]
            assert predict_from_records(shuffled, m, k).predicted_s == prediction.predicted_s


def test_first_messages_posted_early_read_as_any_other():
    # KFKBSchedule from its second step on: each kind's first receive posted as the step
    # starts, so the first message moves when sent and is one more sample of its link. Two
    # stages (each port one kind of message: the model the step came from), links slower than
    # every pass: read exactly, no first-message times, and the step predicted exactly.
    rng = random.Random(11)
    for m in (4, 8):
        f = [rng.uniform(0.5, 1.5) for _ in range(2)]
        b = [2 * x for x in f]
        for k in (1, 2, m):
            records, step = _records_from_simulation(f, b, [3.0], m, k, 9.0, early=True)
            prediction = predict_from_records(records, m, k)
            profile = prediction.profile
            assert profile.first_posted_early and profile.first_transfer_s == ()
            assert profile.transfer_s == pytest.approx([3.0], abs=1e-9)
            assert prediction.predicted_s == pytest.approx(step, rel=1e-9)
            vector = records[1].to_vector(m)  # the flag crosses the controller's all-gather
            assert record_from_vector(vector, m).first_early == 1.0


def test_slow_link_reads_exactly_and_grows():
    # A link slower than the compute always makes the receiver wait: read exactly.
    seen = []
    for c in (1.5, 3.0, 6.0):
        records, _ = _records_from_simulation([1.0, 1.0], [2.0, 2.0], [c], 4, 1, 0.1)
        seen.append(profile_from_records(records, 2).transfer_s[0])
    assert seen == pytest.approx([1.5, 3.0, 6.0], abs=1e-9)


def test_vector_round_trip_and_errors():
    record = RankRecord(3, 1, 5, 0.5, 1.0, 9.0, 64.0, 8.0, (1.0, 2.0), (1.5, NOT_BLOCKED), (0.5,))
    m = 4
    vector = record.to_vector(m)
    assert len(vector) == vector_width(m)
    back = record_from_vector(vector, m)
    assert back.sent_next == record.sent_next and back.sent_prev == ()
    assert back.posted_prev == (0.5,) and back.posted_next == ()
    assert back.arrived_prev == (1.5, NOT_BLOCKED, NOT_BLOCKED, NOT_BLOCKED)
    assert (back.rank, back.stage, back.next_rank, back.step_s) == (3, 1, 5, 9.0)
    assert (
        record_from_vector(RankRecord(0, 1, None, 1, 1, 1, 1, 0).to_vector(m), m).next_rank is None
    )
    with pytest.raises(ValueError, match="num_microbatches"):
        record.to_vector(1)
    with pytest.raises(ValueError, match="record vector"):
        record_from_vector(vector[:-1], m)
    with pytest.raises(ValueError, match="every stage"):
        profile_from_records([record], 2)


def test_overhead_is_spread_over_the_passes():
    # Two stages, m = 2 messages each way, median passes f = 1, b = 2 (6 s of passes). Stage 0
    # took 6 s: nothing outside its passes. Stage 1 took 6.9 s, 0.5 s of it blocked for its
    # first activation (asked 1.0, arrived 1.5), 0.4 s of overhead_s: 0.1 s more per pass.
    nb = NOT_BLOCKED
    r0 = RankRecord(0, 0, 1, 1.0, 2.0, 6.0, 8.0, 4.0, (0.0, 1.0), posted_next=(0.0, 0.0),
                    arrived_next=(nb, nb), asked_next=(5.0, 6.0))  # fmt: skip
    r1 = RankRecord(1, 1, None, 1.0, 2.0, 6.9, 8.0, 0.0, arrived_prev=(1.5, nb),
                    posted_prev=(0.0, 0.0), sent_prev=(3.0, 4.0), asked_prev=(1.0, 2.0),
                    overhead_s=0.4)  # fmt: skip
    profile = profile_from_records([r0, r1], 2)
    assert profile.forward_s == (1.0, pytest.approx(1.1)) and profile.backward_s[1] == 2.1
    assert record_from_vector(r1.to_vector(2), 2).overhead_s == 0.4
    # 0.8 s more of stage 1's step in its passes, beyond their medians (a descheduled pass):
    # 1.2 s outside median passes and blocked waits, 0.3 s a pass.
    slow = dataclasses.replace(r1, step_s=7.7)
    assert profile_from_records([r0, slow], 2).forward_s == (1.0, pytest.approx(1.3))
    # Of those 0.3 s a pass, the 0.8 s beyond overhead_s (0.2 s a pass) came in jumps: the
    # simulator's jitter; 0.5 s of stage 1's 6.9 s step were overhead_s and a wait: none.
    assert profile_from_records([r0, slow], 2).jitter_s == (0.0, pytest.approx(0.2))
    assert profile.jitter_s == (0.0, pytest.approx(0.0, abs=1e-12))
    # Without the times asked, the blocked wait is unknown: overhead_s alone, no jitter.
    old = dataclasses.replace(slow, asked_prev=())
    assert profile_from_records([r0, old], 2).forward_s == (1.0, pytest.approx(1.1))
    assert profile_from_records([r0, old], 2).jitter_s == (0.0, 0.0)


def test_link_time_and_latency_split_by_hand():
    # A link holding each activation 0.2 s, then 0.5 s of latency (a queue behind a tenant).
    # The first message, sent and asked for at 0, lands 0.9: 0.9 - 0.5 = 0.4 s of its own.
    # Sent at 1.0 (after every landing so far): lands 1.7, alone: 0.7 = 0.2 + 0.5. Sent at 1.1
    # and 1.2, before 1.7: they queue on the link and land 0.2 apart (1.9, 2.1). Sent at 3.0:
    # alone again, 3.7. Queued samples 0.2, 0.2; alone 0.7, 0.7: link 0.2, latency 0.5.
    sent = [0.0, 1.0, 1.1, 1.2, 3.0]
    arrived, asked = [0.9, 1.7, 1.9, 2.1, 3.7], [0.0, 1.0, 1.75, 2.0, 3.0]
    links = link_seconds(_pair(sent, [0.0] * 5, arrived, asked), 2)
    assert links["F"] == (pytest.approx(0.2),) and links["LF"] == (pytest.approx(0.5),)
    assert links["F0"] == (pytest.approx(0.4),) and links["LB"] == (0.0,)
    profile = profile_from_records(_pair(sent, [0.0] * 5, arrived, asked), 2)
    assert profile.latency_s == links["LF"] and profile.latency_up_s == (0.0,)
    # Only alone messages (no queue): all of it is link time, no latency.
    spaced = [0.0, 1.0, 2.0, 3.0, 4.0]
    alone = link_seconds(_pair(spaced, [0.0] * 5, [0.9, 1.7, 2.7, 3.7, 4.7], spaced), 2)
    assert alone["F"] == (pytest.approx(0.7),) and alone["LF"] == (0.0,)


def test_latency_read_back_from_simulated_steps():
    # Steps simulated with link time c and latency L after it (f = 1, b = 2, m = 8, first
    # messages 0.5 s). Where a direction has both queued and lone messages, c and L read back
    # exactly; where it has one kind only, c + L reads as link time. The prediction from the
    # split is never worse than from c + L as link time, and better in most cases.
    for c, lat in ((1.5, 1.0), (2.0, 3.0)):
        records, _ = _records_from_simulation([1.0] * 2, [2.0] * 2, [c], 8, 2, 0.5, lat)
        profile = profile_from_records(records, 2, shared_ports=False)
        assert profile.transfer_s == pytest.approx((c,)) and profile.latency_s == (
            pytest.approx(lat),
        )
        assert profile.first_transfer_s == pytest.approx((0.5,))
    better = 0
    for p, k, (c, lat) in itertools.product((2, 4), (1, 2, 4), ((0.5, 2), (1.5, 1), (2, 3))):
        records, step = _records_from_simulation(
            [1.0] * p, [2.0] * p, [c] * (p - 1), 8, k, 0.5, lat
        )
        found = predict_from_records(records, 8, k)
        prof = found.profile
        lumped = dataclasses.replace(
            prof,
            transfer_s=tuple(map(operator.add, prof.transfer_s, prof.latency_s)),
            transfer_up_s=tuple(map(operator.add, prof.transfer_up_s, prof.latency_up_s)),
            first_transfer_s=tuple(map(operator.add, prof.first_transfer_s, prof.latency_s)),
            first_transfer_up_s=tuple(
                map(operator.add, prof.first_transfer_up_s, prof.latency_up_s)
            ),
            latency_s=(),
            latency_up_s=(),
        )
        lumped_error = abs(simulate_profile(lumped, 8, k).step_time - step) / step
        assert found.relative_error <= lumped_error + 1e-9, (p, k, c, lat)
        better += found.relative_error < lumped_error - 0.01
    assert better >= 8


def test_tensor_parallel_group_takes_its_shortest_rank_pass():
    # PP=2 x TP=2 (ranks 0, 1 on stage 0; 2, 3 on stage 1; next-stage peer 2 ranks ahead).
    # Rank 3's input came early, so its forwards also waited in the all-reduce for rank 2's
    # late input (6 s against 2 s): the group's pass is 2 s. Stage 0's group: 1 and 1.5 s.
    def rank(r, forward):
        nxt = r + 2 if r < 2 else None
        # One pass each way and no message lists: a step of the two passes, nothing outside.
        return RankRecord(r, r // 2, nxt, forward, 1.0, forward + 1.0, 8.0, 4.0 if nxt else 0.0)

    records = [rank(0, 1.0), rank(1, 1.5), rank(2, 2.0), rank(3, 6.0)]
    assert profile_from_records(records, 2).forward_s == (1.0, 2.0)
    # Data parallelism, no tensor parallelism (PP=2 x DP=2: next-stage peer 1 ahead): each
    # rank is its own group and the stage takes its slowest replica (ranks 1 and 3: 5 s).
    dp = [RankRecord(0, 0, 1, 1.0, 1.0, 2.0, 8.0, 4.0),
          RankRecord(1, 1, None, 3.0, 1.0, 4.0, 8.0, 0.0),
          RankRecord(2, 0, 3, 1.0, 1.0, 2.0, 8.0, 4.0),
          RankRecord(3, 1, None, 5.0, 1.0, 6.0, 8.0, 0.0)]  # fmt: skip
    assert profile_from_records(dp, 2).forward_s == (1.0, 5.0)


def test_landings_of_the_other_direction_share_the_port_time():
    # Three stages; gradients 2 -> 1 and one activation 0 -> 1 share rank 1's download. The
    # first gradient lands 0.5; the second (sent 0.6) is not waited for; the third (sent 0.7)
    # lands 2.0. The activation (sent 0.65) lands 1.2, in between. Since the first gradient's
    # landing the port delivered three messages (two gradients, the activation): 1.5 s / 3 =
    # 0.5 s each (counting the gradients alone: 0.75; from the activation's landing: 0.8).
    nb = NOT_BLOCKED
    r0 = RankRecord(0, 0, 1, 1.0, 1.0, 2.0, 8.0, 4.0, sent_next=(0.65,))
    r1 = RankRecord(1, 1, 2, 1.0, 1.0, 2.0, 8.0, 4.0, arrived_prev=(1.2,), posted_prev=(0.0,),
                    asked_prev=(0.0,), arrived_next=(0.5, nb, 2.0), posted_next=(0.0,) * 3,
                    asked_next=(0.0, 0.6, 1.9))  # fmt: skip
    r2 = RankRecord(2, 2, None, 1.0, 1.0, 2.0, 8.0, 0.0, sent_prev=(0.0, 0.6, 0.7))
    assert link_seconds([r0, r1, r2], 3)["B"] == (0.0, pytest.approx(0.5))


def test_unseen_landings_of_the_other_direction_share_the_port_time_too():
    # As above, but rank 1 found the activation (sent 0.65) already landed when it asked for it
    # at 1.5: it landed in (0.65, 1.5], between the first gradient's landing (0.5) and the
    # third's (2.0), so the port still delivered three messages in 1.5 s: 0.5 s each. Asked
    # for only at 2.1, it may have landed after 2.0: not counted (1.5 s / 2 = 0.75), and the
    # least bound is the two gradients sent from 0.6 on: 1.4 s / 2 = 0.7.
    nb = NOT_BLOCKED
    r0 = RankRecord(0, 0, 1, 1.0, 1.0, 2.0, 8.0, 4.0, sent_next=(0.65,))
    r2 = RankRecord(2, 2, None, 1.0, 1.0, 2.0, 8.0, 0.0, sent_prev=(0.0, 0.6, 0.7))
    for asked, seconds in ((1.5, 0.5), (2.1, 0.7)):
        r1 = RankRecord(1, 1, 2, 1.0, 1.0, 2.0, 8.0, 4.0, arrived_prev=(nb,), posted_prev=(0.0,),
                        asked_prev=(asked,), arrived_next=(0.5, nb, 2.0), posted_next=(0.0,) * 3,
                        asked_next=(0.0, 0.6, 1.9))  # fmt: skip
        assert link_seconds([r0, r1, r2], 3)["B"] == (0.0, pytest.approx(seconds))


def test_the_busiest_port_bounds_the_time_not_both_ports_together():
    # Four stages, one port each way per rank. Gradients 2 -> 1 leave rank 2's upload and enter
    # rank 1's download: the first lands 0.5 (seen), the second (sent 0.6) 2.0. In between each
    # of those ports carried one activation: 2 -> 3 on rank 2's upload (landed 0.9) and 0 -> 1 on
    # rank 1's download (landed 1.0). The two ports run side by side, so each delivered two
    # messages since 0.5: 1.5 s / 2 = 0.75 s each. Counting both activations (as one port) gave
    # 1.5 s / 3 = 0.5; the second gradient's own bound from the last landing on its ports is
    # 2.0 - 1.0 = 1.0.
    r0 = RankRecord(0, 0, 1, 1.0, 1.0, 2.0, 8.0, 4.0, sent_next=(0.55,))
    r1 = RankRecord(1, 1, 2, 1.0, 1.0, 2.0, 8.0, 4.0, arrived_prev=(1.0,), posted_prev=(0.0,),
                    asked_prev=(0.0,), arrived_next=(0.5, 2.0), posted_next=(0.0, 0.0),
                    asked_next=(0.0, 1.9))  # fmt: skip
    r2 = RankRecord(2, 2, 3, 1.0, 1.0, 2.0, 8.0, 4.0, sent_next=(0.56,), sent_prev=(0.0, 0.6))
    r3 = RankRecord(3, 3, None, 1.0, 1.0, 2.0, 8.0, 0.0, arrived_prev=(0.9,), posted_prev=(0.0,),
                    asked_prev=(0.0,))  # fmt: skip
    records = [r0, r1, r2, r3]
    assert link_seconds(records, 4)["B"] == (0.0, pytest.approx(0.75), 0.0)
    assert link_seconds(records[::-1], 4) == link_seconds(records, 4)
