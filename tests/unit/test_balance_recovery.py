"""Recoveries are released within a few steps, also for a straggler left near no work
(balance/recovery.py, the detector's sudden release and ``rebase``, the controller's
immediate re-plan after a recovery), against hand-computed readings; and no release where a
reading fell by less than the fixed fraction's error can explain."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from colossal_hetero.balance.detector import (
    DetectorSettings,
    StragglerDetector,
    shares_of,
    work_units,
)
from colossal_hetero.balance.recovery import RecoveryWatch, near_empty, recovered, seeds_of
from tests.unit.test_balance_controller import EVEN, _controller, _drive
from tests.unit.test_balance_replan import _Proportional

BENCH = DetectorSettings(smoothing=1.0, threshold=0.3, release=0.1, stable_tolerance=0.25)


def test_near_empty_ranks_and_seeds():
    # 4 ranks: n * share 0.04 and 0.2 are under 0.25; 1.0 and 2.76 are not.
    shares = (0.69, 0.01, 0.25, 0.05)
    assert near_empty(shares) == {1, 3}
    # Seeds: flagged ranks near empty at the new widths, at 1 / their planned speed.
    assert seeds_of((1.0, 0.25, 1.0, 0.5), shares, (1, 2)) == {1: 4.0}


def test_a_fall_at_the_same_widths_or_under_the_seed_squared_releases():
    shares = (0.37, 0.01, 0.37, 0.25)  # rank 1 near empty (0.04); rank 3 loaded (1.0)
    # Quiet s9 run 1, semi: GPT-2's 4x rank read 3.92 then 1.176 at the same widths:
    # 3.92 / 1.176 = 3.33 >= 1.5. Rank 3 fell as much but is loaded: its level counts.
    now = (1.0, 1.176, 1.0, 1.0)
    assert recovered((1, 3), shares, (1.0, 3.92 / 1.176, 1.0, 3.0), {}, now, 1.6) == (1,)
    # Llama's 2x rank, 1.47 then 1.14: 1.29 < 1.5, kept.
    assert recovered((1,), shares, (1.0, 1.47 / 1.14, 1.0, 1.0), {}, now, 1.6) == ()
    # Across a move, against the seed: a recovered 4x rank planned at 4.07 reading 1.44 at no
    # work (fit 0.3 against 0.4): 2.83 >= 1.5 ** 2 = 2.25; a 2x rank planned at 2.0 reading
    # 1.2 under a fit of 0.4 against 0.2: 1.67 < 2.25, kept (it is still slow); a 4x rank
    # planned at 4.2 reading 1.8 (a fit pulled up by load): 2.33, but over the cap 1.6, kept.
    flat = (1.0,) * 4
    assert recovered((1,), shares, flat, {1: 4.07 / 1.44}, (1, 1.44, 1, 1), 1.6) == (1,)
    assert recovered((1,), shares, flat, {1: 2.0 / 1.2}, (1, 1.2, 1, 1), 1.6) == ()
    assert recovered((1,), shares, flat, {1: 4.2 / 1.8}, (1, 1.8, 1, 1), 1.6) == ()


def test_the_watch_records_readings_and_restarts_with_seeds():
    watch, shares, cap = RecoveryWatch(), (0.49, 0.01), 1.8
    assert watch.update((1.0, 4.0), shares, (1,), cap) == ()
    assert watch.update((1.0, 3.0), shares, (1,), cap) == ()  # 4 / 3 < 1.5
    assert watch.update((1.0, 2.5), shares, (1,), cap) == (1,)  # 4 / 2.5 = 1.6, any level
    watch.restart({1: 4.0})  # a move: readings forgotten, the seed kept
    assert watch.slowest == {} and watch.update((1.0, 2.0), shares, (1,), cap) == ()  # < 2.25
    assert watch.update((1.0, 1.7), shares, (1,), cap) == (1,)  # 4 / 1.7 = 2.35, 1.7 <= 1.8
    watch.restart()
    assert watch.update((1.0, 1.0), shares, (1,), cap) == ()  # nothing recorded yet: no fall


def _reading(detector: StragglerDetector, step: int, factor: float) -> Any:
    return detector.update(step, [[0.1], [0.1 * factor]], (0.5, 0.5))


@pytest.mark.parametrize(
    ("first", "then", "flagged"),
    [(4.0, 1.2, ()), (1.5, 1.2, (1,)), (4.0, 2.6, (1,)), (4.0, 1.35, (1,))],
)
def test_a_sudden_fall_below_the_threshold_releases(first, then, flagged):
    """Threshold 0.3, release 0.1 (the bench's): 4.0 -> 1.2 fell 3.33 > 1.6 to under 1.3:
    released; 1.5 -> 1.2 fell 1.25 (a hover: release needs < 1.1); 4.0 -> 2.6 fell 1.54 <
    1.6; 4.0 -> 1.35 fell far but is over 1.3."""
    detector = StragglerDetector(2, BENCH)
    assert _reading(detector, 0, first).stragglers == (1,)
    assert _reading(detector, 1, then).stragglers == flagged


def test_no_sudden_release_across_a_reset():
    """After a move the slowdown before is of other widths: hysteresis alone decides."""
    detector = StragglerDetector(2, BENCH)
    _reading(detector, 0, 4.0)
    detector.reset(1)
    assert _reading(detector, 2, 1.2).stragglers == (1,)


def test_rebase_releases_and_reads_only_changes():
    """Rank 1 reads 1.44 (its level off by the fit), flagged; rebased it reads 1.0, stays
    released at the same times, reads 4.0 when its times grow 4x, and 1.44 after a reset."""
    detector = StragglerDetector(2, BENCH)
    assert _reading(detector, 0, 1.44).stragglers == (1,)
    state = detector.rebase(2, (1,))
    assert state.slowdown == pytest.approx((1.0, 1.0)) and state.stragglers == ()
    assert state.stable_since == 2
    for step in (4, 6, 8):
        assert _reading(detector, step, 1.44).stragglers == ()
    slow = _reading(detector, 10, 4 * 1.44)
    assert slow.slowdown[1] == pytest.approx(4.0) and slow.stragglers == (1,)
    detector.reset(12)
    assert _reading(detector, 14, 1.44).slowdown[1] == pytest.approx(1.44)


class _EightX(_Proportional):
    """Rank 1 at 8x for steps 6..29; the cluster's fixed fraction is 0.4 (configured 0.2)."""

    def slow(self, step: int) -> float:
        return 8.0 if 6 <= step < 30 else 1.0

    def times(self, step: int) -> list[float]:
        units = work_units(shares_of(self.widths, 2), 0.4)
        return [1e-3 * units[0], 1e-3 * units[1] * self.slow(step)]


@pytest.mark.parametrize("mode", ["replan", "semi"])
def test_a_recovered_near_empty_straggler_is_released_and_moved_back_at_once(
    monkeypatch: Any, mode: str
):
    """The bench's knobs. Flagged at 7 (8.0, sudden), re-planned to ffn (95, 1) (planning
    speeds (1, 0.014) at phi 0.2); the fit from rank 0 alone (rank 1 is near empty after the
    move: 2 / 96 x 2 = 0.04) reads the cluster's 0.4 exactly, phi (0.2 + 0.4) / 2 = 0.3.

    By hand at phi 0.3, widths (95, 1): model units 1.6854 and 0.31458, true ones (0.4)
    1.5875 and 0.4125. At 8x rank 1 reads (8 x 0.4125 / 0.31458) / (1.5875 / 1.6854) =
    11.137; recovered (window 29..31 at 31), 1.3113 / 0.94192 = 1.392: over the release
    1.1, so hysteresis alone kept it flagged. The fall 11.137 / 1.392 = 8.0 >= 1.5 releases
    it at 31, and the fall by over 1.6 re-plans at once, to the even widths."""
    cluster = _EightX()
    controller = _controller(cluster, mode, monkeypatch, fixed_fraction=0.2)
    controller.settings = replace(
        controller.settings, every=2, threshold=0.3, release=0.1, stable_tolerance=0.25
    )
    controller.settings = replace(controller.settings, stable_steps=2)
    controller.detector = StragglerDetector(2, replace(BENCH, smoothing=0.9))
    _drive(controller, cluster, 50)
    assert cluster.moves == [{"ffn": (95, 1)}, EVEN]
    records = {r["step"]: r for r in controller.log.records if "slowdown" in r["inputs"]}
    assert all(records[s]["inputs"]["stragglers"] == [1] for s in range(7, 31, 2))
    assert records[9]["inputs"]["fixed_fraction"] == pytest.approx(0.3)
    assert records[29]["inputs"]["slowdown"][1] == pytest.approx(11.137, abs=1e-3)
    back = records[31]
    t0, t1 = back["inputs"]["times"]
    w0, w1 = work_units(shares_of({"ffn": (95, 1)}, 2), 0.3)
    # The level, by hand; times are logged to 1e-6 s: 0.5e-6 / 0.4125e-3 = 1.2e-3 on t1,
    # 0.3e-3 on t0.
    assert (t1 / w1) / (t0 / w0) == pytest.approx(1.3921, rel=1.6e-3)
    assert back["inputs"]["recovered"] == [1] and back["inputs"]["stragglers"] == []
    assert back["decision"]["action"] == "resize" and back["decision"]["widths"] == {
        "ffn": [48, 48]
    }
    assert all(records[s]["inputs"]["stragglers"] == [] for s in range(31, 50, 2))


def test_slowdowns_are_read_against_the_loaded_ranks():
    """Per-unit times 0.2, 0.2 and 0.1 (rank 2 near no work, its fixed part over a fit that
    is too high): against every rank the two equal loaded ranks read 2.0 and are flagged;
    against the loaded ranks (0, 1) they read 1.0 and rank 2 reads at least 1. A loaded rank
    twice as slow still reads 2.0."""
    window, shares = [[0.1], [0.1], [0.01]], (0.5, 0.5, 0.1)
    state = StragglerDetector(3, BENCH).update(0, window, shares)
    assert state.slowdown == pytest.approx((2.0, 2.0, 1.0)) and state.stragglers == (0, 1)
    state = StragglerDetector(3, BENCH).update(0, window, shares, loaded={0, 1})
    assert state.slowdown == pytest.approx((1.0, 1.0, 1.0)) and state.stragglers == ()
    state = StragglerDetector(3, BENCH).update(0, [[0.1], [0.2], [0.01]], shares, {0, 1})
    assert state.slowdown == pytest.approx((1.0, 2.0, 1.0)) and state.stragglers == (1,)
