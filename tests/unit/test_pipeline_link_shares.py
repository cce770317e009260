"""pipeline/link_shares.py: message pieces over a stage's TP links, sized by measured speeds.

Oracles: brute force over every way to place the units, arithmetic by hand, and hand-built
step records (two stages of two TP ranks, one link ten times slower than the other).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from colossal_hetero.pipeline.controller import _step_gain
from colossal_hetero.pipeline.link_shares import (
    LinkEstimate,
    LinkReading,
    LinkShareTuner,
    balanced_units,
    even_units,
    next_units,
    piece_bounds,
    quantum_for,
    scaled_profile,
    step_readings,
)
from colossal_hetero.pipeline.profile import NOT_BLOCKED, RankRecord
from colossal_hetero.pipeline.tuner import PipelineProfile, simulate_profile, tp_index_of_rank


def test_piece_bounds_tile_the_message_within_an_element_of_each_share():
    for numel, units in [(1024, (3, 13)), (1000, (5, 6, 5)), (17, (1, 16)), (16, (8, 8))]:
        bounds = piece_bounds(numel, units)
        assert bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
        for (lo, hi), u in zip(bounds, units, strict=True):
            assert hi > lo and abs((hi - lo) - numel * u / sum(units)) < 1
    assert piece_bounds(1024, (3, 13)) == [(0, 192), (192, 1024)]
    with pytest.raises(ValueError, match="^units"):
        piece_bounds(64, (0, 16))
    with pytest.raises(ValueError, match="^numel"):
        piece_bounds(10, (8, 8))


def _brute_force(spu, latency, quantum, floor=1):
    best = math.inf
    for units in itertools.product(range(floor, quantum + 1), repeat=len(spu)):
        if sum(units) == quantum:
            cost = max(lat + u * s for u, s, lat in zip(units, spu, latency, strict=True))
            best = min(best, cost)
    return best


def test_balanced_units_match_brute_force():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.choice((2, 3))
        quantum = rng.choice((n, 8, 12, 16))
        spu = [rng.choice((0.0, rng.uniform(0.001, 0.1))) for _ in range(n)]
        latency = [rng.choice((0.0, rng.uniform(0.0, 0.2))) for _ in range(n)]
        units = balanced_units(spu, latency, quantum=quantum)
        assert sum(units) == quantum and min(units) >= 1
        got = max(lat + u * s for u, s, lat in zip(units, spu, latency, strict=True))
        assert got == pytest.approx(_brute_force(spu, latency, quantum), rel=1e-12)
    # Equal links: equal shares; a link 7x slower carries 2 of 16 (2 * 7 = 14 = 14 * 1).
    assert balanced_units([0.01, 0.01]) == (8, 8)
    assert balanced_units([0.07, 0.01]) == (2, 14)
    with pytest.raises(ValueError, match="^quantum"):
        balanced_units([0.01] * 3, quantum=2)
    with pytest.raises(ValueError, match="^seconds_per_unit"):
        balanced_units([0.01, math.nan])


def test_quantum_and_even_units():
    assert quantum_for(2) == 16 and quantum_for(3) == 18 and quantum_for(32) == 32
    assert even_units(2) == (8, 8) and even_units(3) == (6, 6, 6)


def test_next_units_by_hand():
    # 8:8; link 0 held each message 160 ms (20 ms a unit), link 1 20 ms (2.5 ms a unit).
    # 1:15 lands in max(20, 37.5) = 37.5 ms, 2:14 in max(40, 35) = 40 ms: 1:15.
    slow, fast = LinkReading(8, 0.16), LinkReading(8, 0.02)
    units, kept = next_units((8, 8), [slow, fast], [None, None], min_gain=0.1)
    assert units == (1, 15)
    assert kept == (LinkEstimate(0.02), LinkEstimate(0.0025))
    # 2.5 vs 2 ms a unit: 7:9 lands in max(17.5, 18) = 18 ms, 10% sooner than 8:8's 20 ms.
    # It replaces 8:8 only when that beats min_gain.
    near = [LinkReading(8, 0.02), LinkReading(8, 0.016)]
    assert next_units((8, 8), near, [None, None], min_gain=0.15)[0] == (8, 8)
    assert next_units((8, 8), near, [None, None], min_gain=0.05)[0] == (7, 9)
    # A link never measured and never seen landed is unknown: the units stay.
    hidden = LinkReading(8, 0.0)
    assert next_units((8, 8), [slow, hidden], [None, None], 0.1) == ((8, 8), (kept[0], None))


def test_a_link_that_kept_up_keeps_its_estimate_bounded_by_its_landings():
    # Link 0 carries 1 unit and kept up: its known 20 ms a unit stays (it may still be
    # preempted), unless its landings bound it lower: landed within 5 ms of release.
    known = (LinkEstimate(0.02), LinkEstimate(0.0025))
    kept_up = LinkReading(1, 0.0)
    fast = LinkReading(15, 0.0375)
    assert next_units((1, 15), [kept_up, fast], known, 0.1)[0] == (1, 15)
    recovered = LinkReading(1, 0.0, landed_within_s=0.005)
    units, kept = next_units((1, 15), [recovered, fast], known, 0.1)
    assert kept[0] == LinkEstimate(0.005)
    # 0.005 vs 0.0025 a unit: 5:11 lands in max(25, 27.5) ms, against 1:15's 37.5 ms.
    assert units == (5, 11)


def _records(slow_s: float, fast_s: float, m: int = 4) -> list[RankRecord]:
    """PP=2 x TP=2: ranks 0, 1 send m activations at t = 0, 1, ...; their peers 2, 3 posted
    every receive at 0, asked at send time and waited ``slow_s`` / ``fast_s`` for each."""
    sent = tuple(float(j) for j in range(m))

    def upstream(rank: int) -> RankRecord:
        return RankRecord(rank, 0, rank + 2, 0.1, 0.2, m, 1e6, 4096.0, sent_next=sent)

    def downstream(rank: int, took: float) -> RankRecord:
        arrived = tuple(t + took for t in sent)
        return RankRecord(
            rank, 1, None, 0.1, 0.2, m, 1e6, 0.0, arrived_prev=arrived,
            posted_prev=(0.0,) * m, asked_prev=sent, first_early=1.0,
        )  # fmt: skip

    return [upstream(0), upstream(1), downstream(2, slow_s), downstream(3, fast_s)]


def test_tuner_moves_units_off_the_slow_link_and_back():
    tuner = LinkShareTuner(2, tp_index_of_rank(2, 2, 1), tp=2, min_gain=0.1)
    assert tuner.units == {("F", 0): (8, 8), ("B", 0): (8, 8)}
    readings = step_readings(_records(0.2, 0.02), tuner.tp_index_of_rank, tuner.units)
    assert [r.per_message_s for r in readings[("F", 0)]] == pytest.approx([0.2, 0.02])
    assert [r.per_message_s for r in readings[("B", 0)]] == [0.0, 0.0]  # no gradients sent
    units = tuner.decide(_records(0.2, 0.02), dict(tuner.units))
    # 25 ms vs 2.5 ms a unit: 1:15 lands in 37.5 ms; gradients unknown, so they stay even.
    assert units == {("F", 0): (1, 15), ("B", 0): (8, 8)}
    assert tuner.per_boundary() == ([(1, 15)], [(8, 8)])
    # The tenant leaves: its 1 unit now takes 2.5 ms, the other's 15 take 37.5 ms.
    units = tuner.decide(_records(0.0025, 0.0375), {("F", 0): (1, 15), ("B", 0): (8, 8)})
    assert units[("F", 0)] == (8, 8)


def test_tuner_refuses_a_single_tp_rank():
    with pytest.raises(ValueError, match="^tp"):
        LinkShareTuner(2, [0, 0], tp=1, min_gain=0.1)


def test_not_blocked_is_the_links_marker():
    # The readings treat a receive that did not wait as hidden: the records' marker.
    records = _records(0.2, 0.02)
    hidden = [
        r if r.rank != 3 else RankRecord(**{**r.to_dict(), "arrived_prev": (NOT_BLOCKED,) * 4})
        for r in records
    ]
    readings = step_readings(hidden, [0, 1, 0, 1], {("F", 0): (8, 8)})
    assert readings[("F", 0)][1].per_message_s == 0.0
    # It landed by the time it was asked for, which was when it was sent: within 0 s.
    assert readings[("F", 0)][1].landed_within_s == 0.0


def test_one_odd_step_moves_no_units_over_a_window():
    # Two steps of equal links, then one where link 0 read 10x slower: the window's median
    # still has them equal. Without a window that one step moves the units.
    windowed = LinkShareTuner(2, [0, 1, 0, 1], tp=2, min_gain=0.25, window=3)
    for slow in (0.02, 0.02, 0.2):
        units = windowed.decide(_records(slow, 0.02), dict(windowed.units))
    assert units[("F", 0)] == (8, 8)
    medians = windowed.estimates(("F", 0))
    assert [e.seconds_per_unit for e in medians if e] == pytest.approx([0.0025, 0.0025])
    # Two slow steps of three: the median is slow, and the units move.
    units = windowed.decide(_records(0.2, 0.02), dict(windowed.units))
    assert units[("F", 0)] == (1, 15)
    single = LinkShareTuner(2, [0, 1, 0, 1], tp=2, min_gain=0.25)
    for slow in (0.02, 0.02, 0.2):
        units = single.decide(_records(slow, 0.02), dict(single.units))
    assert units[("F", 0)] == (1, 15)
    with pytest.raises(ValueError, match="^window"):
        LinkShareTuner(2, [0, 1, 0, 1], tp=2, min_gain=0.25, window=0)


def test_units_move_only_when_the_step_gains():
    # 8:8 at 200 ms and 20 ms a message; 1:15 lands in 37.5 ms: factor 0.1875 on F0.
    asked: list[tuple] = []

    def gain(direction, factor):
        asked.append((direction, factor))
        return 0.02

    tuner = LinkShareTuner(2, [0, 1, 0, 1], tp=2, min_gain=0.25, min_step_gain=0.03)
    units = tuner.decide(_records(0.2, 0.02), dict(tuner.units), gain)
    assert units[("F", 0)] == (8, 8)  # the link was slow, but the step would gain only 2%
    assert asked == [(("F", 0), pytest.approx(0.0375 / 0.2))]
    units = tuner.decide(_records(0.2, 0.02), dict(tuner.units), lambda d, f: 0.5)
    assert units[("F", 0)] == (1, 15)


def _profile(transfer_s: float, latency_s: float = 0.005) -> PipelineProfile:
    return PipelineProfile(
        forward_s=(0.01, 0.01),
        backward_s=(0.02, 0.02),
        transfer_s=(transfer_s,),
        activation_bytes=(1.0, 1.0),
        memory_budget_bytes=(1e9, 1e9),
        latency_s=(latency_s,),
    )


def test_scaled_profile_by_hand():
    scaled = scaled_profile(_profile(0.1), ("F", 0), 0.5)
    assert scaled.transfer_s == (0.05,) and scaled.latency_s == (0.0025,)
    assert scaled.transfer_up_s == (0.1,) and scaled.latency_up_s == (0.005,)  # made explicit
    back = scaled_profile(_profile(0.1), ("B", 0), 0.5)
    assert back.transfer_s == (0.1,) and back.latency_s == (0.005,)
    assert back.transfer_up_s == (0.05,) and back.latency_up_s == (0.0025,)


def test_step_gain_follows_the_simulator():
    # Links of 100 ms a message set the pace of 10 + 20 ms passes: a tenth of it for the
    # activations gains a quarter of the step (the gradients' 100 ms still hold it). At 1 ms a
    # message and no latency the transfers hide behind the passes, but for the step's first
    # and last crossings (2 ms of about 150): little to gain.
    slow = _step_gain(_profile(0.1), 4, 1, ("F", 0), 0.1)
    sim = simulate_profile(_profile(0.1), 4, 1).step_time
    fast = simulate_profile(scaled_profile(_profile(0.1), ("F", 0), 0.1), 4, 1).step_time
    assert slow == pytest.approx(1 - fast / sim) and slow > 0.2
    assert 0 <= _step_gain(_profile(0.001, 0.0), 4, 1, ("F", 0), 0.1) < 0.03
