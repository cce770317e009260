"""The straggler detector (pure): flags an emulated slowdown within a few windows, does not
flap under constant noisy load, hysteresis, normalisation by work share, stability count; and
the agreed view of the gathered rows (balance/window.py)."""

from __future__ import annotations

import math
import random

import pytest

from colossal_hetero.balance.detector import (
    DetectorSettings,
    StragglerDetector,
    flag_stragglers,
    shares_of,
)
from colossal_hetero.balance.window import Agreed, Report, pack, unpack

SETTINGS = DetectorSettings(smoothing=0.5, threshold=0.15, release=0.05, stable_tolerance=0.1)
EVEN = (0.25, 0.25, 0.25, 0.25)


def _windows(rng: random.Random, factors: list[float], noise: float, size: int = 5) -> list:
    """Per rank ``size`` step times: 0.1 s x factor x (1 + uniform noise)."""
    return [[0.1 * f * (1 + rng.uniform(-noise, noise)) for _ in range(size)] for f in factors]


def test_flags_an_emulated_slowdown_within_two_windows_and_releases_after_recovery():
    rng, detector = random.Random(0), StragglerDetector(4, SETTINGS)
    history = []
    for window in range(30):
        factors = [1.0, 3.0 if 10 <= window < 20 else 1.0, 1.0, 1.0]
        history.append(detector.update(window, _windows(rng, factors, 0.02), EVEN))
    # +-2% noise: two ranks' times differ by at most 1.02 / 0.98 = 1.041 (< 1.15, < 1.05).
    assert all(d.stragglers == () for d in history[:10])
    # EWMA weight 0.5: after one slow window s >= (0.5 + 0.5 * 3) * 0.98 / 1.02 > 1.15.
    assert history[10].stragglers == (1,)
    assert all(d.stragglers == (1,) for d in history[10:20])
    assert 3 / 1.041 < history[19].slowdown[1] < 3 * 1.041 + 2 * 0.5**9  # EWMA settled
    released = next(w for w in range(20, 30) if history[w].stragglers == ())
    # The EWMA halves the excess each window: 2 * 0.5^8 < 0.05 - 0.041 after 8 windows.
    assert released <= 28
    assert all(d.slowdown[0] >= 1.0 and min(d.slowdown) == 1.0 for d in history)


@pytest.mark.parametrize("seed", range(5))
def test_no_flapping_under_constant_load_with_noise(seed: int):
    """Equal ranks, +-5% noise per step, 200 windows: never flagged. Guaranteed, not lucky:
    any two ranks' medians (and so their EWMAs) differ by at most 1.05 / 0.95 = 1.105."""
    rng, detector = random.Random(seed), StragglerDetector(4, SETTINGS)
    states = [detector.update(w, _windows(rng, [1.0] * 4, 0.05), EVEN) for w in range(200)]
    assert all(d.stragglers == () for d in states)
    assert max(max(d.slowdown) for d in states) <= 1.05 / 0.95


@pytest.mark.parametrize("seed", range(5))
def test_hysteresis_a_rank_near_the_threshold_flips_at_most_once(seed: int):
    """A rank at 1.15x (on the threshold) with noise: once flagged it stays flagged, since
    release needs < 1.05."""
    rng, detector = random.Random(seed), StragglerDetector(2, SETTINGS)
    states = [detector.update(w, _windows(rng, [1.0, 1.15], 0.06), (0.5, 0.5)) for w in range(300)]
    changes = sum(a.stragglers != b.stragglers for a, b in zip(states, states[1:], strict=False))
    assert changes <= 1


def test_flag_rule_thresholds():
    on, none = frozenset({0}), frozenset()
    assert flag_stragglers([1.16, 1.0], none, SETTINGS) == [0]
    assert flag_stragglers([1.15, 1.0], none, SETTINGS) == []  # strictly above to flag
    assert flag_stragglers([1.06, 1.0], on, SETTINGS) == [0]  # still above release
    assert flag_stragglers([1.04, 1.0], on, SETTINGS) == []


def test_normalised_by_work_share_and_to_the_fastest_rank():
    """Rank 0 runs 3/4 of the work in 3x the time of rank 1 (1/4): the same device speed."""
    detector = StragglerDetector(2, SETTINGS)
    state = detector.update(0, [[0.3], [0.1]], (0.75, 0.25))
    assert state.slowdown == pytest.approx((1.0, 1.0)) and state.stragglers == ()
    state = StragglerDetector(2, SETTINGS).update(0, [[0.2], [0.1]], (0.5, 0.5))
    assert state.slowdown == (2.0, 1.0) and state.speeds == (0.5, 1.0)


def test_stability_counts_from_the_last_change_and_reset_restarts_it():
    detector = StragglerDetector(2, SETTINGS)
    steps = [detector.update(step, [[0.1], [0.3]], (0.5, 0.5)) for step in (4, 9, 14)]
    assert [d.stable_since for d in steps] == [4, 4, 4] and steps[-1].stable_for() == 10
    moved = detector.update(19, [[0.1], [0.2]], (0.5, 0.5))  # EWMA 3 -> 2.5: > 10% change
    assert moved.stable_since == 19
    detector.reset(24)
    assert detector.update(29, [[0.1], [0.2]], (0.5, 0.5)).stable_since == 29


def test_shares_of_widths():
    assert shares_of({"heads": (3, 1), "ffn": (48, 48)}, 2) == pytest.approx((0.625, 0.375))
    assert shares_of({}, 4) == EVEN


def test_rows_pack_unpack_and_the_slowest_copy_per_position():
    """tp=2 x dp=2: position 1's slow copy (group 2) is the one taken."""
    reports = [
        Report(0, 0, (0.1, 0.1), 0.5, 1e9, 0.0, 100.0, 10.0),
        Report(1, 0, (0.1, 0.12), 0.5, 2e9, 0.0, 100.0, 10.0),
        Report(0, 2, (0.11, 0.1), 0.6, 1e9, 0.3, 100.0, 10.0),
        Report(1, 2, (0.4,), 0.7, 0.0, 0.0, 100.0, 10.0),
    ]
    rows = [pack(r, 3) for r in reports]
    assert all(len(row) == len(rows[0]) for row in rows) and math.isnan(rows[3][-3])
    assert unpack(rows[3]) == reports[3]
    agreed = Agreed.of(rows, 2)
    assert agreed.positions == (reports[2], reports[3])
    assert agreed.times == (pytest.approx(0.105), 0.4)
    # bandwidth: the highest rank's (the last to arrive waits for the transfer alone)
    assert agreed.step_time == 0.7 and agreed.bandwidth == 2e9 and agreed.move_s == 0.3
    assert agreed.groups() == {0: [0.1, 0.11], 2: [0.105, 0.4]}
