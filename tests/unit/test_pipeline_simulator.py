"""The pipeline simulator against hand-computed timelines and closed forms."""

from __future__ import annotations

import pytest

from colossal_hetero.pipeline.order import kfkb_order
from colossal_hetero.pipeline.simulator import DESCHEDULE_S, Trace, simulate


def uniform(p: int, f: float, b: float, c: float) -> tuple[list[float], list[float], list[Trace]]:
    return [f] * p, [b] * p, [Trace.constant(c)] * (p - 1)


def test_hand_computed_two_stages():
    # p=2, m=2, k=1, f=1, b=2, transfer 0.5. Stage 0 runs F0 F1 B0 B1, stage 1 F0 B0 F1 B1:
    # s0 F0 [0,1] -> lands 1.5; F1 [1,2] -> link free at 1.5, lands 2.5
    # s1 F0 [1.5,2.5]  B0 [2.5,4.5] -> grad lands 5.0;  F1 [4.5,5.5]  B1 [5.5,7.5] -> lands 8.0
    # s0 B0 [5,7]  B1 [8,10]
    r = simulate(*uniform(2, 1.0, 2.0, 0.5), num_microbatches=2, k=1, activation_bytes=[3.0, 5.0])
    assert r.step_time == 10.0
    assert r.busy == (6.0, 6.0) and r.idle == (4.0, 4.0)
    assert r.peak_in_flight == (2, 1) and r.peak_memory == (6.0, 5.0)
    spans = {(e.stage, e.op, e.mb): (e.start, e.end) for e in r.events}
    assert spans[(1, "F", 1)] == (4.5, 5.5) and spans[(0, "B", 0)] == (5.0, 7.0)


def test_link_is_fifo_one_transfer_at_a_time():
    # p=2, m=3, k=3 (GPipe), f=1, transfer 2: stage 0 finishes forwards at 1, 2, 3 but the link
    # delivers at 3, 5, 7 (each waits for the previous); stage 1 forwards end at 4, 6, 8, its
    # backwards (b=1) at 9, 10, 11; gradients land at 11, 13, 15; stage 0 backwards end 12, 14, 16.
    r = simulate(*uniform(2, 1.0, 1.0, 2.0), num_microbatches=3, k=3)
    arrivals = sorted(e.start for e in r.events if e.stage == 1 and e.op == "F")
    assert arrivals == [3.0, 5.0, 7.0]
    assert r.step_time == 16.0


def test_free_transfers_give_the_classic_bound_for_every_k():
    for p in (1, 2, 3, 4, 6):
        for m in (1, 4, 8, 12):
            for k in range(1, m + 1):
                if m % k:
                    continue
                r = simulate(*uniform(p, 1.0, 2.0, 0.0), num_microbatches=m, k=k)
                assert r.step_time == (m + p - 1) * 3.0, (p, m, k)


def test_1f1b_uniform_bound_with_other_times():
    r = simulate(*uniform(4, 0.25, 0.5, 0.0), num_microbatches=16, k=1)
    assert r.step_time == pytest.approx((16 + 4 - 1) * 0.75, abs=1e-12)  # sums of dyadic floats
    assert all(b == 16 * 0.75 for b in r.busy)


def test_latency_hiding_rows_of_the_digest_table():
    # seeds_2d_pipe_moe.md 2.3 (p=4, m=16, f=1, b=2), the rows where a transfer (c <= f) is not
    # slower than the compute feeding its link, so one-at-a-time links change nothing:
    table = {0.0: [57, 57, 57, 57, 57], 1.0: [85, 63, 63, 63, 63]}
    for c, row in table.items():
        got = [simulate(*uniform(4, 1.0, 2.0, c), 16, k).step_time for k in (1, 2, 4, 8, 16)]
        assert got == row


def test_digest_table_with_latency():
    # The whole table of seeds_2d_pipe_moe.md 2.3 (p=4, m=16, f=1, b=2) treats c as latency:
    # it overlaps with the next transfer on the same link.
    table = {
        0.0: [57, 57, 57, 57, 57],
        1.0: [85, 63, 63, 63, 63],
        2.0: [113, 74, 69, 69, 69],
        4.0: [169, 106, 81, 81, 81],
    }
    free = [Trace.constant(0.0)] * 3
    for c, row in table.items():
        got = [
            simulate([1.0] * 4, [2.0] * 4, free, 16, k, latency_s=[c] * 3).step_time
            for k in (1, 2, 4, 8, 16)
        ]
        assert got == row, c
        # and large k pays only fill and drain: (m + p - 1)(f + b) + 2c(p - 1)
        assert got[-1] == (16 + 4 - 1) * 3 + 2 * c * 3


def test_gpipe_pays_only_fill_and_drain_latency_when_links_keep_up():
    # k = m with c <= f: (m + p - 1)(f + b) + 2c(p - 1), the digest's large-k makespan.
    for p, m, f, b, c in [(4, 16, 1.0, 2.0, 0.5), (3, 6, 1.0, 1.0, 1.0), (5, 10, 2.0, 3.0, 1.5)]:
        r = simulate(*uniform(p, f, b, c), num_microbatches=m, k=m)
        assert r.step_time == (m + p - 1) * (f + b) + 2 * c * (p - 1)


def test_1f1b_pays_transfers_inside_the_steady_state():
    # The slowest stage-pair round trip is paid per micro-batch: 1F1B grows faster in c than kFkB.
    slow = [simulate(*uniform(4, 1.0, 2.0, c), 16, 1).step_time for c in (0.0, 0.5, 1.0)]
    grouped = [simulate(*uniform(4, 1.0, 2.0, c), 16, 4).step_time for c in (0.0, 0.5, 1.0)]
    assert slow[2] - slow[0] > 2 * (grouped[2] - grouped[0])


def test_trace_straddling_a_change():
    trace = Trace((0.0, 1.0), (2.0, 0.5))
    assert trace.finish(0.5) == 1.375  # quarter done by t=1 at 2 s/transfer, rest at 0.5 s
    assert trace.finish(3.0) == 3.5
    assert Trace((0.0, 2.0), (0.0, 4.0)).finish(1.0) == 1.0
    # A step that starts late on a trace sees the later transfer time.
    fast = simulate([1.0, 1.0], [1.0, 1.0], [trace], 2, 1, start_time=10.0)
    assert fast.step_time == simulate(*uniform(2, 1.0, 1.0, 0.5), 2, 1).step_time


def test_heterogeneous_stage_is_the_bottleneck():
    # The middle stage (f=2, b=4) computes back to back but for two gaps: it waits 1 for stage
    # 0's F0, and after its warm-up (F0 [1,3], F1 [3,5]) 1 more for stage 2's F0+B0 ([3,6]).
    # Then 8 * 6 of work ending at 50, and stage 0's last backward [50, 52].
    r = simulate([1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [Trace.constant(0.0)] * 2, 8, 1)
    assert r.step_time == 1 + 1 + 8 * 6.0 + 2
    assert r.idle[1] == 1 + 1 + 2  # the two gaps and the tail after its last pass
    assert r.busy == (24.0, 48.0, 24.0)


def test_memory_follows_the_order():
    r = simulate(*uniform(4, 1.0, 2.0, 0.0), 8, 2, activation_bytes=[10.0] * 4)
    peaks = [min(2 * (4 - s), 8) for s in range(4)]
    assert r.peak_in_flight == tuple(peaks)
    assert r.peak_memory == tuple(10.0 * n for n in peaks)
    assert len(r.events) == 4 * 2 * 8
    for s in range(4):  # each stage runs exactly its kfkb_order
        ran = [(e.op, e.mb) for e in sorted(r.events, key=lambda e: e.start) if e.stage == s]
        assert ran == kfkb_order(4, s, 8, 2)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(starts=(1.0,), seconds=(1.0,)),
        dict(starts=(0.0, 0.0), seconds=(1.0, 1.0)),
        dict(starts=(0.0,), seconds=(-1.0,)),
    ],
)
def test_bad_traces(kwargs):
    with pytest.raises(ValueError, match="^trace:"):
        Trace(**kwargs)


def test_bad_lengths():
    with pytest.raises(ValueError, match="boundary traces"):
        simulate([1.0, 1.0], [1.0, 1.0], [], 2, 1)
    with pytest.raises(ValueError, match="latency_s"):
        simulate([1.0, 1.0], [1.0, 1.0], [Trace()], 2, 1, latency_s=[-1.0])


def test_shared_ports_queue_a_middle_stage_sends_in_both_directions():
    # p=3, m=3, k=1, f=b=1, every message 3 s. Separate links (by hand): s1 sends F0 at 5
    # (lands 8), F1 at 8 (11), B0 at 14 (s0 at 17), F2 at 15 (lands 18), B1 at 17 (s0 at 20);
    # s2 B2 ends at 20 (s1 at 23), s1 B2 [23,24] lands 27, s0 B2 [27,28]: step 28.
    # Shared ports: s1's upload carries B0 [14,17] before F2, so F2 leaves it at 20 and lands
    # at 20; s1's B1 (ends 17) waits for the upload until 20 and lands 23 on s0; s2 F2 [20,21]
    # B2 [21,22] lands 25 on s1; s1 B2 [25,26] lands 29; s0 B2 [29,30]: step 30.
    f, b, c = uniform(3, 1.0, 1.0, 3.0)
    assert simulate(f, b, c, 3, 1).step_time == 28.0
    shared = simulate(f, b, c, 3, 1, shared_ports=True)
    assert shared.step_time == 30.0
    spans = {(e.stage, e.op, e.mb): (e.start, e.end) for e in shared.events}
    assert spans[(2, "F", 2)] == (20.0, 21.0) and spans[(0, "B", 1)] == (23.0, 24.0)
    # Two stages: each port carries one kind of message, so sharing changes nothing.
    for k in (1, 2, 4):
        two = uniform(2, 1.0, 2.0, 1.5)
        assert simulate(*two, 4, k, shared_ports=True) == simulate(*two, 4, k)


def test_up_transfers_slow_only_the_gradients():
    # p=2, m=1: F0 [0,1] lands at 1.5 (activation 0.5); stage 1 F0 [1.5,2.5] B0 [2.5,3.5], its
    # gradient takes 4 s (lands 7.5); B0 on stage 0 [7.5,8.5].
    slow_up = [Trace.constant(4.0)]
    r = simulate([1.0, 1.0], [1.0, 1.0], [Trace.constant(0.5)], 1, 1, up_transfers=slow_up)
    assert r.step_time == 8.5
    with pytest.raises(ValueError, match="up_transfers"):
        simulate([1.0, 1.0], [1.0, 1.0], [Trace()], 1, 1, up_transfers=[])


def test_first_message_moves_once_asked_for():
    free = [Trace.constant(0.0)]
    # p=2, m=2, k=1, f=b=1, free links, the first message 3 s from when it is asked for.
    # s1 asks for F0 at 0; s0 sends it at 1: lands 4; F1 (sent 2) queues behind it: lands 4.
    # s1 F0 [4,5] B0 [5,6]; s0 asked for B0 at 2 (after F1): lands 9. s1 F1 [6,7] B1 [7,8]
    # lands 9 behind B0. s0 B0 [9,10] B1 [10,11].
    assert simulate([1.0, 1.0], [1.0, 1.0], free, 2, 1, first_s=[3.0]).step_time == 11.0
    # Sent before it is asked for: s0 F0 [0,5] F1 [5,10]; F0 lands 8, s1 F0 [8,9] B0 [9,9.5]
    # sends B0 at 9.5, but s0 asks for it only at 10 (after F1): it lands 13. F1 lands 10,
    # s1 F1 [10,11] B1 [11,11.5], B1 lands 13 behind B0; s0 B0 [13,14] B1 [14,15].
    r = simulate([5.0, 1.0], [1.0, 0.5], free, 2, 1, first_s=[3.0])
    assert r.step_time == 15.0
    assert {(e.stage, e.op, e.mb): e.start for e in r.events}[(0, "B", 0)] == 13.0
    # The gradients' own first time, 0: as the first case until s1's B0 ends at 6, which lands
    # at once (s0 asked at 2); s1 F1 [6,7] B1 [7,8]; s0 B0 [6,7] B1 [8,9].
    own = simulate([1.0] * 2, [1.0] * 2, free, 2, 1, first_s=[3.0], first_up_s=[0.0])
    assert own.step_time == 9.0
    with pytest.raises(ValueError, match="first_s"):
        simulate([1.0, 1.0], [1.0, 1.0], free, 2, 1, first_s=[-1.0])


def test_first_message_posted_early_moves_when_sent():
    # p=2, m=2, k=1, f=[5, 1], b=[1, 0.5], links 1 s a message. Receives of each kind's first
    # message posted as the step starts: s0 F0 [0,5] F1 [5,10]; F0 lands 6, s1 F0 [6,7]
    # B0 [7,7.5]; B0 lands 8.5 though s0 asks for it only at 10 (after F1): s0 B0 [10,11].
    # F1 lands 11 (s1 asked at 0); s1 F1 [11,12] B1 [12,12.5], B1 lands 13.5; s0 B1 [13.5,14.5].
    one = [Trace.constant(1.0)]
    r = simulate([5.0, 1.0], [1.0, 0.5], one, 2, 1, first_early=True)
    assert r.step_time == 14.5
    assert {(e.stage, e.op, e.mb): e.start for e in r.events}[(0, "B", 0)] == 10.0
    # Each first message timed from its ask instead (3 s: its metadata read first): F0 lands
    # 8, s1 F0 [8,9] B0 [9,9.5]; B0 held to s0's ask at 10, lands 13: s0 B0 [13,14] B1
    # [14,15]. ``first_s`` does not apply to early receives.
    assert simulate([5.0, 1.0], [1.0, 0.5], one, 2, 1, first_s=[3.0]).step_time == 15.0
    assert (
        simulate([5.0, 1.0], [1.0, 0.5], one, 2, 1, first_s=[3.0], first_early=True).step_time
        == 14.5
    )


def test_latency_per_direction_overlaps_where_link_time_queues():
    # p=2, m=2, GPipe (k=2), f=b=1. Activations hold the link 0.5 s and then take 2 s more
    # (latency: a queue behind other traffic that both activations wait out together). F0 sent
    # at 1 leaves the link at 1.5, lands 3.5; F1 sent at 2 leaves at 2.5, lands 4.5. s1 F0
    # [3.5,4.5] F1 [4.5,5.5] B0 [5.5,6.5] B1 [6.5,7.5]; gradients 0.5 s, no latency: B0 lands
    # 7.0, B1 8.0; s0 B0 [7,8] B1 [8,9].
    f = [1.0, 1.0]
    link = [Trace.constant(0.5)]
    r = simulate(f, f, link, 2, 2, latency_s=[2.0], up_latency_s=[0.0])
    assert r.step_time == 9.0
    # The same 2.5 s per activation as link time: F1 moves only after F0 left (3.5), lands 6.
    # s1 F0 [3.5,4.5] F1 [6,7] B0 [7,8] B1 [8,9]; B0 lands 8.5, B1 9.5; s0 B0 [8.5,9.5]
    # B1 [9.5,10.5].
    slow = simulate(f, f, [Trace.constant(2.5)], 2, 2, up_transfers=link)
    assert slow.step_time == 10.5
    # The latency on both directions (up_latency_s left out): B0 lands 9.0, B1 (sent 7.5,
    # off the link 8.0) 10.0; s0 B0 [9,10] B1 [10,11].
    assert simulate(f, f, link, 2, 2, latency_s=[2.0]).step_time == 11.0
    with pytest.raises(ValueError, match="up_latency_s"):
        simulate(f, f, link, 2, 2, up_latency_s=[-1.0])


def test_token_bucket_credit_after_an_idle_link():
    # p=2, m=3, GPipe, f=b=1, link 2 s a message, bucket 1.5 s. Activations: F0 (ready 1, link
    # idle: full credit) lands 1 - 1.5 + 2 = 1.5; F1 (ready 2, idle 0.5 s) 2 - 0.5 + 2 = 3.5;
    # F2 (ready 3, link busy to 3.5: none) 5.5. Stage 1: F [1.5,2.5] [3.5,4.5] [5.5,6.5],
    # B [6.5,7.5] [7.5,8.5] [8.5,9.5]; gradients land 8 (full credit), 10 (0.5 s), 12 (none);
    # stage 0: B [8,9] [10,11] [12,13]. Without the bucket the same step takes 16.
    f, b, c = uniform(2, 1.0, 1.0, 2.0)
    r = simulate(f, b, c, 3, 3, burst_s=[1.5])
    spans = {(e.stage, e.op, e.mb): (e.start, e.end) for e in r.events}
    assert [spans[(1, "F", i)][0] for i in range(3)] == [1.5, 3.5, 5.5]
    assert [spans[(0, "B", i)][0] for i in range(3)] == [8.0, 10.0, 12.0]
    assert r.step_time == 13.0
    assert simulate(f, b, c, 3, 3, burst_s=[0.0]) == simulate(f, b, c, 3, 3)
    # Gradients without a bucket: stage 1's B end at 7.5, 8.5, 9.5 and land 9.5, 11.5, 13.5.
    assert simulate(f, b, c, 3, 3, burst_s=[1.5], up_burst_s=[0.0]).step_time == 14.5
    with pytest.raises(ValueError, match="burst_s"):
        simulate(f, b, c, 3, 3, burst_s=[-1.0])


def test_token_bucket_on_shared_ports_takes_the_smaller_credit():
    # p=3, m=2, k=2, f=b=1, 2 s a message, bucket 1 s, shared ports. s0 F [0,1] [1,2]: F0 leaves
    # s0's idle upload at 1 - 1 + 2 = 2 into s1's idle download (lands 2); F1 (ready 2) finds
    # both ports just freed (no credit): lands 4. s1 F0 [2,3] lands 4 on s2; s1 F1 [4,5]: its
    # upload idled 1 s, s2's download 1 s: lands 5 - 1 + 2 = 6. s2 F [4,5] [6,7], B [7,8] [8,9]:
    # B0 lands 9 on s1 (s1's download idle since 4), B1 11 (back to back). s1 B0 [9,10] lands
    # 11 on s0; B1 [11,12]: upload idled since 11 (1 s credit), s0's download since 11: 13.
    # s0 B [11,12] [13,14]. Without the bucket: 18 (every message its full 2 s).
    f, b, c = uniform(3, 1.0, 1.0, 2.0)
    r = simulate(f, b, c, 2, 2, shared_ports=True, burst_s=[1.0, 1.0])
    spans = {(e.stage, e.op, e.mb): (e.start, e.end) for e in r.events}
    assert [spans[(1, "F", i)][0] for i in range(2)] == [2.0, 4.0]
    assert [spans[(2, "F", i)][0] for i in range(2)] == [4.0, 6.0]
    assert [spans[(1, "B", i)][0] for i in range(2)] == [9.0, 11.0]
    assert r.step_time == 14.0
    assert simulate(f, b, c, 2, 2, shared_ports=True).step_time == 18.0
    # A bucket on boundary 1 only: s0 F lands 3, 5 (full 2 s); s1 F [3,4] [5,6] land 5, 7 on
    # s2 (both ports idled 1 s); s2 F [5,6] [7,8] B [8,9] [9,10], gradients land 10, 12 on s1;
    # s1 B [10,11] [12,13] land 13, 15 on s0 (no credit); s0 B [13,14] [15,16].
    assert simulate(f, b, c, 2, 2, shared_ports=True, burst_s=[0.0, 1.0]).step_time == 16.0


def test_token_debt_lands_a_message_as_it_starts():
    # p=2, m=2, 1F1B, f=b=1, 2 s a message, the shaper charging after (htb's negative tokens).
    # s0 F0 [0,1]: lands 1, link closed to 3; s0 F1 [1,2]: ready 2, starts 3, lands 3. s1 F0
    # [1,2] B0 [2,3]: gradient lands 3 (link closed to 5); s1 F1 [3,4] B1 [4,5]: lands 5.
    # s0 B0 [3,4] B1 [5,6]: 6. Charged before landing (a FIFO link) the same step takes 10:
    # activations land 3 and 5, s1 F0 [3,4] B0 [4,5] F1 [5,6] B1 [6,7], gradients 7 and 9.
    f, b, c = uniform(2, 1.0, 1.0, 2.0)
    r = simulate(f, b, c, 2, 1, token_debt=True)
    spans = {(e.stage, e.op, e.mb): (e.start, e.end) for e in r.events}
    assert [spans[(1, "F", i)][0] for i in range(2)] == [1.0, 3.0]
    assert [spans[(0, "B", i)][0] for i in range(2)] == [3.0, 5.0]
    assert r.step_time == 6.0
    assert simulate(f, b, c, 2, 1).step_time == 10.0
    # GPipe, m=3: back-to-back messages still land one transfer time apart. Activations ready
    # 1, 2, 3 land 1, 3, 5; s1 F [1,2] [3,4] [5,6] B [6,7] [7,8] [8,9]; gradients ready 7, 8, 9
    # land 7, 9, 11; s0 B [7,8] [9,10] [11,12]. With a 1 s bucket: activations land 1 (closed
    # to 2), 2 (to 4), 4; s1 F [1,2] [2,3] [4,5] B [5,6] [6,7] [7,8]; gradients 6 (to 7), 7, 9.
    assert simulate(f, b, c, 3, 3, token_debt=True).step_time == 12.0
    assert simulate(f, b, c, 3, 3, token_debt=True, burst_s=[1.0]).step_time == 10.0


def test_token_debt_on_shared_ports():
    # p=3, m=2, k=2, f=b=1, 2 s a message, shared ports, charged after landing. s0 F0 [0,1]
    # lands 1 on s1 (s0's upload and s1's download closed to 3); s0 F1 (ready 2) waits for s0's
    # upload: lands 3. s1 F0 [1,2] lands 2 on s2, s1 F1 [3,4] lands 4 (s1's upload free at 4).
    # s2 F [2,3] [4,5] B [5,6] [6,7]: gradients land 6 on s1 (ports closed to 8) and 8. s1 B0
    # [6,7] lands 7 on s0, B1 [8,9] lands 9 (s1's upload free at 9). s0 B [7,8] [9,10]: 10,
    # against 18 charged before landing (test above).
    f, b, c = uniform(3, 1.0, 1.0, 2.0)
    r = simulate(f, b, c, 2, 2, shared_ports=True, token_debt=True)
    spans = {(e.stage, e.op, e.mb): (e.start, e.end) for e in r.events}
    assert [spans[(1, "F", i)][0] for i in range(2)] == [1.0, 3.0]
    assert [spans[(1, "B", i)][0] for i in range(2)] == [6.0, 8.0]
    assert [spans[(0, "B", i)][0] for i in range(2)] == [7.0, 9.0]
    assert r.step_time == 10.0
    # Two stages: each port carries one kind, so shared ports change nothing here either.
    f2, b2, c2 = uniform(2, 1.0, 1.0, 2.0)
    for k in (1, 2):
        alone = simulate(f2, b2, c2, 2, k, token_debt=True)
        assert simulate(f2, b2, c2, 2, k, shared_ports=True, token_debt=True) == alone


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_without_events_the_times_are_the_events_sums(k, shared):
    """``keep_events=False`` (the tuner's path) gives the step as the latest pass end and the
    busy seconds as each stage's sum over its passes, bit for bit, and no events."""
    f, b = [0.011, 0.007, 0.013, 0.009], [0.02, 0.017, 0.025, 0.019]
    down = [Trace.constant(0.004), Trace((0.0, 0.05), (0.03, 0.002)), Trace.constant(0.0)]
    up = [Trace.constant(0.006), Trace.constant(0.001), Trace((0.0, 0.1), (0.0, 0.02))]
    kw = dict(latency_s=[0.001, 0.0, 0.002], up_transfers=up, shared_ports=shared,
              first_s=[0.005, 0.003, 0.004], burst_s=[0.0, 0.002, 0.0])  # fmt: skip
    full = simulate(f, b, down, 10, k, **kw)
    lean = simulate(f, b, down, 10, k, keep_events=False, **kw)
    assert lean.events == () and len(full.events) == 2 * 10 * 4
    assert lean.step_time == max(e.end for e in full.events)
    assert lean.busy == tuple(
        sum(e.end - e.start for e in full.events if e.stage == s) for s in range(4)
    )
    assert (lean.idle, lean.peak_memory) == (full.idle, full.peak_memory)


def _jittered_pass_seconds(seconds, jitter, stage, n):
    """Pass ``n`` of ``stage`` by the rule the simulator documents, written out here:
    share q = jitter / slice, phase = frac((stage + 1) * golden); a jump when n q + phase
    crosses an integer; every pass jitter shorter, a jump jitter / q longer."""
    if jitter == 0:
        return seconds
    q = min(1.0, jitter / DESCHEDULE_S)
    phase = ((stage + 1) * (5**0.5 - 1) / 2) % 1.0
    crosses = int((n + 1) * q + phase) - int(n * q + phase)
    return seconds - jitter + crosses * jitter / q


def _free_link_step(f, b, jitter, m, k):
    """Brute-force step time on free links (transfers land at once): each stage runs its order;
    a pass starts when its stage is free and its input's pass on the neighbour has ended."""
    p = len(f)
    orders = [kfkb_order(p, s, m, k) for s in range(p)]
    end, pos, free = {}, [0] * p, [0.0] * p
    while any(pos[s] < len(orders[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(orders[s]):
                op, mb = orders[s][pos[s]]
                src = s - 1 if op == "F" else s + 1
                if 0 <= src < p and (src, op, mb) not in end:
                    break
                ready = end.get((src, op, mb), 0.0)
                seconds = (f if op == "F" else b)[s]
                start = max(free[s], ready)
                free[s] = start + _jittered_pass_seconds(seconds, jitter[s], s, pos[s])
                end[(s, op, mb)] = free[s]
                pos[s] += 1
    return max(free)


def test_jitter_keeps_a_lone_stages_total():
    # One stage, 4 micro-batches: 8 passes, share 0.003 / 0.006 = 0.5 of them jump, 4 exactly
    # (q n crosses 4 integers in 8 passes): 4 * (0.010 + 0.020) in all, as without jitter.
    result = simulate([0.010], [0.020], [], 4, 1, jitter_s=[0.003])
    assert result.step_time == pytest.approx(0.120, abs=1e-12)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_jitter_matches_the_pass_rule_and_slows_1f1b(k):
    f, b, jitter = [0.010, 0.011, 0.009], [0.020, 0.018, 0.021], [0.002, 0.003, 0.0045]
    free = [Trace.constant(0.0)] * 2
    result = simulate(f, b, free, 8, k, jitter_s=jitter)
    assert result.step_time == pytest.approx(_free_link_step(f, b, jitter, 8, k), abs=1e-12)
    plain = simulate(f, b, free, 8, k).step_time
    assert plain == pytest.approx(_free_link_step(f, b, [0.0] * 3, 8, k), abs=1e-12)
    if k == 1:  # every pass waits on a neighbour: a late one delays the others
        assert result.step_time > plain + 1e-4


def test_jitter_beyond_a_pass_is_refused():
    with pytest.raises(ValueError, match="jitter_s"):
        simulate([0.010, 0.010], [0.020, 0.020], [Trace.constant(0.0)], 4, 1, jitter_s=[0.011, 0])
    with pytest.raises(ValueError, match="jitter_s"):
        simulate([0.010, 0.010], [0.020, 0.020], [Trace.constant(0.0)], 4, 1, jitter_s=[0.001])
