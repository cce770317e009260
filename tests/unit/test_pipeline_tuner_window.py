"""The Ada tuner's window choice (``choose_k_over_window``) against a brute-force sum of
simulated step times, and the detected memory budget."""

from __future__ import annotations

import random

import pytest
import torch

from colossal_hetero.pipeline.order import expected_peak_in_flight
from colossal_hetero.pipeline.simulator import Trace, simulate
from colossal_hetero.pipeline.tuner import PipelineProfile, choose_k, choose_k_over_window
from colossal_hetero.utils.device import available_memory_bytes


def _profile(p: int, link: float, act: float = 1.0, budget: float = 1e9) -> PipelineProfile:
    return PipelineProfile((1.0,) * p, (2.0,) * p, (link,) * (p - 1), (act,) * p, (budget,) * p)


def _brute(profiles: list[PipelineProfile], m: int, ks: list[int]) -> dict[int, float]:
    """Summed simulated step times of every k, straight from the simulator."""
    return {
        k: sum(
            simulate(
                pr.forward_s, pr.backward_s, [Trace.constant(c) for c in pr.transfer_s], m, k
            ).step_time
            for pr in profiles
        )
        for k in ks
    }


def test_one_profile_is_choose_k():
    rng = random.Random(3)
    for _ in range(20):
        prof = _profile(rng.randint(2, 4), rng.uniform(0.0, 4.0))
        assert choose_k_over_window([prof], 8) == choose_k(prof, 8)


def test_window_sums_the_steps_and_rides_out_flips():
    # A link that flips between free and preempted (3 forward-times a message) each step.
    p, m = 4, 8
    free, busy = _profile(p, 0.0), _profile(p, 3.0)
    window = [free, busy, free, busy]
    decision = choose_k_over_window(window, m)
    want = _brute(window, m, list(range(1, m + 1)))
    assert decision.step_s_by_k == pytest.approx(want, rel=1e-12)
    assert decision.k == min(k for k, t in want.items() if t <= min(want.values()) * (1 + 1e-9))
    # The last step alone was free: it would pick 1F1B, which loses the preempted steps.
    assert choose_k(free, m).k == 1 and decision.k > 1
    assert want[decision.k] < want[1]


def test_window_respects_the_largest_activations():
    # The last step measured smaller activations; the window's largest still bounds k.
    p, m = 2, 8
    big = _profile(p, 3.0, act=2.0, budget=8.0)  # stage 0 holds min(2k, 8) micro-batches
    small = _profile(p, 3.0, act=1.0, budget=8.0)
    decision = choose_k_over_window([big, small], m)
    assert max(decision.step_s_by_k) == 2  # 2 * min(2k, 8) <= 8 only for k <= 2
    for s in range(p):
        assert expected_peak_in_flight(p, s, m, decision.k) * 2.0 <= 8.0
        assert decision.peak_memory_bytes[s] <= 8.0
    with pytest.raises(ValueError, match="profiles"):
        choose_k_over_window([], m)


def test_available_memory_is_positive_and_split_among_local_ranks():
    whole = available_memory_bytes(torch.device("cpu"))
    quarter = available_memory_bytes(torch.device("cpu"), local_world_size=4)
    assert whole > 0
    # MemAvailable moves between the two reads; a quarter of it within 10% of the whole.
    assert 0.9 * whole / 4 <= quarter <= 1.1 * whole / 4


def test_cache_gives_the_same_decision_and_simulates_each_profile_once():
    p, m = 3, 6
    window = [_profile(p, c) for c in (0.0, 2.0, 0.5)]
    cache: dict = {}
    first = choose_k_over_window(window[:2], m, cache=cache)
    assert first == choose_k_over_window(window[:2], m)
    assert len(cache) == 2 * m  # each profile once per candidate
    cache[(window[0], 1)] = 1e9  # a cached value is used, not recomputed
    again = choose_k_over_window(window, m, cache=cache)
    assert len(cache) == 3 * m and again.step_s_by_k[1] > 1e9


def test_running_k_wins_a_tie_but_not_a_loss():
    # Free links (a grouped k hides every transfer: nothing waited) tie every k on equal stages.
    p, m = 4, 8
    free = _profile(p, 0.0)
    assert choose_k_over_window([free], m).k == 1
    assert choose_k_over_window([free], m, current_k=2).k == 2
    # A running k that is measurably slower, or no longer fits the budget, gives way.
    busy = _profile(p, 3.0)
    worst = max(choose_k_over_window([busy], m).step_s_by_k.items(), key=lambda kv: kv[1])[0]
    assert choose_k_over_window([busy], m, min_gain=0.03, current_k=worst).k != worst
    tight = _profile(p, 0.0, act=1.0, budget=4.0)  # stage 0 holds min(4k, 8): only k = 1 fits
    assert choose_k_over_window([tight], m, current_k=2).k == 1


def test_one_preempted_step_after_free_ones_moves_k():
    # Three free steps (every k ties) and one whose link takes 0.2 forward-times a message
    # (1F1B 36.2, k = 2 34.2). The saving, 2.0, is more than min_gain of that step (1.03) but
    # less than min_gain of the window's summed time (4.0): it counts against one step, so k
    # moves at once.
    p, m, gain = 4, 8, 0.03
    free, busy = _profile(p, 0.0), _profile(p, 0.2)
    times = _brute([busy], m, list(range(1, m + 1)))
    best = min(times, key=times.get)
    saving = times[1] - times[best]
    whole = 3 * _brute([free], m, [1])[1] + times[best]
    assert saving > gain * times[best] and saving < gain * whole  # the case it is about
    assert choose_k_over_window([free, free, free, busy], m, min_gain=gain, current_k=1).k == best
