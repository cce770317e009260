"""Ada tuner oracles: memory bound, free links, monotone k, the analytic rule, rank agreement."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from colossal_hetero.pipeline.order import kfkb_order, peak_in_flight
from colossal_hetero.pipeline.simulator import Trace, simulate
from colossal_hetero.pipeline.tuner import (
    LocalMeasurement,
    PipelineProfile,
    agree_profile,
    choose_k,
    stage_of_rank,
)


def profile(p, f, b, c, act=1.0, budget=1e9):
    def per(x, n):
        return tuple(x) if isinstance(x, (list, tuple)) else (float(x),) * n

    return PipelineProfile(per(f, p), per(b, p), per(c, p - 1), per(act, p), per(budget, p))


def with_latency(prof: PipelineProfile, latency: float) -> PipelineProfile:
    return dataclasses.replace(prof, latency_s=(latency,) * (prof.num_stages - 1))


def random_profile(rng: random.Random, p: int) -> PipelineProfile:
    return PipelineProfile(
        forward_s=tuple(rng.uniform(0.5, 2.0) for _ in range(p)),
        backward_s=tuple(rng.uniform(1.0, 4.0) for _ in range(p)),
        transfer_s=tuple(rng.uniform(0.0, 3.0) for _ in range(p - 1)),
        activation_bytes=tuple(rng.uniform(1.0, 3.0) for _ in range(p)),
        memory_budget_bytes=tuple(rng.uniform(3.0 * p, 40.0) for _ in range(p)),  # 1F1B fits
        latency_s=tuple(rng.uniform(0.0, 3.0) for _ in range(p - 1)),
    )


def test_matches_brute_force_and_respects_memory():
    rng = random.Random(7)
    for _ in range(60):
        p, m = rng.randint(2, 5), rng.randint(2, 16)
        prof = random_profile(rng, p)
        decision = choose_k(prof, m)
        # Brute force: memory from the order itself, time from the simulator, ties to smaller k.
        feasible = {}
        for k in range(1, m + 1):
            peaks = [peak_in_flight(kfkb_order(p, s, m, k)) for s in range(p)]
            need = [n * a for n, a in zip(peaks, prof.activation_bytes, strict=True)]
            if all(x <= bud for x, bud in zip(need, prof.memory_budget_bytes, strict=True)):
                traces = [Trace.constant(c) for c in prof.transfer_s]
                feasible[k] = simulate(
                    prof.forward_s, prof.backward_s, traces, m, k, latency_s=prof.latency_s
                ).step_time
        best = min(feasible.values())
        assert decision.k == min(k for k, t in feasible.items() if t <= best * (1 + 1e-9))
        assert decision.step_s_by_k == feasible
        used = zip(decision.peak_memory_bytes, prof.memory_budget_bytes, strict=True)
        assert all(x <= bud for x, bud in used)


def test_memory_bound_binds():
    # The digest's p=4, m=16, f=1, b=2 case with latency 2: steps 113, 74, 69, 69, 69 for
    # k = 1, 2, 4, 8, 16, so k=4 (stage 0 holds min(4 * 4, 16) = 16 micro-batches); a budget of
    # 8 micro-batches on stage 0 leaves k <= 2.
    base = dict(f=1.0, b=2.0, c=0.0)
    unbound = choose_k(with_latency(profile(4, **base), 2.0), 16, [1, 2, 4, 8, 16])
    assert unbound.k == 4 and unbound.peak_memory_bytes[0] == 16.0
    assert unbound.step_s_by_k == {1: 113.0, 2: 74.0, 4: 69.0, 8: 69.0, 16: 69.0}
    tight = with_latency(profile(4, **base, budget=(8.0, 16.0, 16.0, 16.0)), 2.0)
    bound = choose_k(tight, 16, [1, 2, 4, 8, 16])
    assert bound.k == 2 and bound.peak_memory_bytes == (8.0, 6.0, 4.0, 2.0)
    assert set(bound.step_s_by_k) == {1, 2}


def test_free_transfers_pick_1f1b():
    # Equal stages, free links: every k gives (m + p - 1)(f + b), so the tie goes to k = 1.
    rng = random.Random(3)
    for _ in range(40):
        p, m = rng.randint(1, 6), rng.randint(1, 20)
        f, b = rng.uniform(0.5, 2.0), rng.uniform(1.0, 4.0)
        decision = choose_k(profile(p, f, b, 0.0, act=rng.uniform(1, 3)), m)
        assert decision.k == 1
        assert decision.predicted_step_s == pytest.approx((m + p - 1) * (f + b), rel=1e-12)


def test_unequal_stages_can_group_even_on_free_links():
    # With unequal stages 1F1B couples each stage to the other's pace micro-batch by micro-batch;
    # grouping decouples them, so a k > 1 can win without any transfer cost (found by the
    # random search above; documented behaviour of the model, not a tuner rule).
    prof = PipelineProfile((1.3, 1.0), (2.8, 2.9), (0.0,), (1.0, 1.0), (1e9, 1e9))
    decision = choose_k(prof, 19)
    assert decision.k > 1 and decision.predicted_step_s < decision.step_s_by_k[1]


def test_k_monotone_in_latency():
    for p, m, (f, b) in itertools.product((2, 3, 4), (4, 6, 8, 12, 16), ((1.0, 2.0), (2.0, 3.0))):
        ks = [choose_k(with_latency(profile(p, f, b, 0.0), i / 4), m).k for i in range(33)]
        assert ks == sorted(ks), (p, m, f, b, ks)
        assert ks[0] == 1 and ks[-1] > 1


def test_k_monotone_in_link_time_while_links_keep_up():
    # Sweep link time c from 0 to min(f, b) (a link not slower than the compute feeding it), with
    # and without a latency on top.
    for p, m, (f, b), lat in itertools.product(
        (2, 3, 4), (4, 8, 12), ((1.0, 2.0), (2.0, 3.0)), (0.0, 1.0)
    ):
        ks = [
            choose_k(with_latency(profile(p, f, b, min(f, b) * i / 20), lat), m).k
            for i in range(21)
        ]
        assert ks == sorted(ks), (p, m, f, b, lat, ks)


def test_homogeneous_choice_is_the_analytic_rule():
    # Over divisors of m, with latency c: the smallest k with (k - 1)(f + b) >= 2c (the digest's
    # closed form); the same with link time c while c <= min(f, b). When m < k * p the rule's k
    # already runs like GPipe on the first stages, and a smaller k can tie it: then the tuner's
    # k is no larger and exactly as fast.
    for p, m, (f, b) in itertools.product((2, 3, 4), (4, 8, 12, 16), ((1.0, 2.0), (1.0, 1.0))):
        divisors = [d for d in range(1, m + 1) if m % d == 0]
        for i in range(21):
            for latency in (0.0, 4.0):
                c = min(f, b) * i / 20
                c_link, c_lat = (0.0, 4 * c) if latency else (c, 0.0)
                want = min([d for d in divisors if (d - 1) * (f + b) >= 2 * (c_link + c_lat)]
                           or [m])  # fmt: skip
                got = choose_k(with_latency(profile(p, f, b, c_link), c_lat), m, divisors)
                if m >= want * p:
                    assert got.k == want, (p, m, f, b, c_link, c_lat)
                else:
                    assert got.k <= want
                    assert got.predicted_step_s <= got.step_s_by_k[want] * (1 + 1e-9)


def test_saturated_link_can_lower_k():
    # Once a transfer is slower than the forward feeding it, the link, not latency, sets the pace
    # and a large group only queues on it: the best k may fall again (documented, not a bug).
    # p=4, m=8, f=b=1: k=4 is best at link time 1.5 (34 vs 35 for k=2), k=2 at 2.5 (49 vs 51).
    at = {c: choose_k(profile(4, 1.0, 1.0, c), 8, [1, 2, 4, 8]) for c in (1.5, 2.5)}
    assert at[1.5].k == 4 and at[2.5].k == 2
    assert at[2.5].step_s_by_k[2] < at[2.5].step_s_by_k[4]


def test_agreement_from_different_local_measurements():
    rng = random.Random(11)
    stage_of_rank = [0, 0, 1, 1, 2, 2]  # PP=3 x TP=2
    rows = [
        LocalMeasurement(
            forward_s=rng.uniform(1, 2), backward_s=rng.uniform(2, 4),
            transfer_s=rng.uniform(0, 2), activation_bytes=rng.uniform(1, 2),
            memory_budget_bytes=rng.uniform(10, 20), latency_s=rng.uniform(0, 2),
        ).to_row()
        for _ in stage_of_rank
    ]  # fmt: skip
    agreed = agree_profile(rows, stage_of_rank, 3)
    assert agreed.forward_s == tuple(max(rows[2 * s][0], rows[2 * s + 1][0]) for s in range(3))
    assert agreed.transfer_s == tuple(max(rows[2 * s][2], rows[2 * s + 1][2]) for s in range(2))
    assert agreed.memory_budget_bytes == tuple(
        min(rows[2 * s][4], rows[2 * s + 1][4]) for s in range(3)
    )
    decision = choose_k(agreed, 8)
    # Each rank sees the gathered rows in its own (any) order: the profile and k do not change.
    for perm in itertools.islice(itertools.permutations(range(6)), 0, 720, 37):
        mine = agree_profile([rows[i] for i in perm], [stage_of_rank[i] for i in perm], 3)
        assert mine == agreed and choose_k(mine, 8) == decision


@pytest.mark.parametrize(
    "prof, m, cands, match",
    [
        (profile(2, 1.0, 1.0, 0.0, act=2.0, budget=(1.0, 9.0)), 4, None, "below one micro-batch"),
        (profile(3, 1.0, 1.0, 0.0, act=1.0, budget=(2.0, 9.0, 9.0)), 4, None, "no k in"),
        (profile(2, 1.0, 1.0, 0.0), 4, [5], "^k:"),
        (PipelineProfile((1.0, 1.0), (1.0, 1.0), (), (1.0, 1.0), (9.0, 9.0)), 4, None,
         "^profile.transfer_s:"),
    ],
)  # fmt: skip
def test_bad_inputs(prof, m, cands, match):
    with pytest.raises(ValueError, match=match):
        choose_k(prof, m, cands)


def test_stage_of_rank_layout():
    # rank (d * pp + s) * tp + t, as HybridParallelPlugin's ProcessGroupMesh(dp, pp, tp).
    assert stage_of_rank(pp=3, tp=2, dp=1) == [0, 0, 1, 1, 2, 2]
    assert stage_of_rank(pp=2, tp=1, dp=2) == [0, 1, 0, 1]
    assert stage_of_rank(pp=2, tp=2, dp=2) == [0, 0, 1, 1, 0, 0, 1, 1]


def test_bad_rows():
    with pytest.raises(ValueError, match="needs a rank"):
        agree_profile([[1.0] * 6], [0], 2)
    with pytest.raises(ValueError, match="finite"):
        agree_profile([[float("nan")] * 6], [0], 1)
    with pytest.raises(ValueError, match="one row of 6"):
        agree_profile([[1.0] * 5], [0], 1)


def test_a_token_bucket_in_the_profile_reaches_the_simulator_and_can_move_k():
    # p=2, m=4, f=b=1, 2 s a message: without a bucket k=2 is best (16 s; 1F1B 18 s). With a
    # 1.5 s bucket 1F1B's messages each find the link idle: activations land 1.5, 3.5 (0.5 s
    # idle), 6.5, 8.5 and gradients 4, 6, 9, 11; stage 0's last backward [11, 12]. Step 12,
    # where GPipe-like groups queue back to back: k=1 wins, as PP=4's free links measured.
    prof = dataclasses.replace(profile(2, 1.0, 1.0, 2.0), burst_s=(1.5,), burst_up_s=(1.0,))
    direct = simulate(
        [1.0, 1.0], [1.0, 1.0], [Trace.constant(2.0)], 4, 1, burst_s=[1.5], up_burst_s=[1.0]
    )
    assert choose_k(prof, 4, [1]).predicted_step_s == direct.step_time
    bucket = choose_k(dataclasses.replace(prof, burst_up_s=(1.5,)), 4)
    assert (bucket.k, bucket.predicted_step_s) == (1, 12.0)
    assert choose_k(profile(2, 1.0, 1.0, 2.0), 4).k == 2
    with pytest.raises(ValueError, match="burst_s"):
        choose_k(dataclasses.replace(prof, burst_s=(1.0, 1.0)), 4)


def test_token_debt_reaches_the_simulator():
    # The hand-computed p=2, m=2, 1F1B step of test_pipeline_simulator: 6 charged after
    # landing, 10 before; k = 2 (GPipe) takes 8: s0 F [0,1] [1,2], activations land 1 and 3,
    # s1 F [1,2] [3,4] B [4,5] [5,6], gradients land 5 and 7, s0 B [5,6] [7,8].
    from colossal_hetero.pipeline.tuner import PipelineProfile, simulate_profile

    profile = PipelineProfile((1.0, 1.0), (1.0, 1.0), (2.0,), (1.0, 1.0), (9.0, 9.0))
    debt = dataclasses.replace(profile, token_debt=True)
    assert simulate_profile(profile, 2, 1).step_time == 10.0
    assert simulate_profile(debt, 2, 1).step_time == 6.0
    assert simulate_profile(debt, 2, 2).step_time == 8.0
