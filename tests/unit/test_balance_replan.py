"""The re-planner's choice of widths and when it re-plans, against hand-computed references.

- ``off_plan``: the planning speeds (measured speeds at the fitted fixed fraction) compared with
  those the widths were planned with, tiny speeds in absolute terms;
- ``best_plan``: the planner's candidate the work model predicts fastest, the rest of the group
  balanced when one rank's floor binds;
- the controller re-plans when only the fitted fixed fraction moved (widths planned at phi 0
  give a 4x rank too much once phi reads 0.2), and SEMI moves back after a recovery that no
  flag shows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest

from colossal_hetero.balance.detector import DetectorSettings, StragglerDetector
from colossal_hetero.balance.replan import (
    balanced_key,
    best_plan,
    flagged_speeds,
    held_speeds,
    measurable_slowdown,
    model_times,
    off_plan,
    planning_speeds,
    reading_drops,
    segment_time,
)
from tests.unit.test_balance_controller import EVEN, _Cluster, _controller, _drive


def test_off_plan_relative_above_the_tolerance_absolute_below():
    # 0.76 planned, 1.0 now: 0.24 > 0.25 * 0.76 = 0.19 -> off.
    assert off_plan((1.0, 1.0), (1.0, 0.76), 0.25)
    assert not off_plan((1.0, 0.8), (1.0, 0.76), 0.25)  # 0.04 <= 0.19
    # Near no width: 0.049 -> 0.013 moves under 0.25 * 0.25 = 0.0625 -> not off; 0.13 -> 0.049
    # moves 0.081 -> off.
    assert not off_plan((1.0, 0.013), (1.0, 0.049), 0.25)
    assert off_plan((1.0, 0.049), (1.0, 0.13), 0.25)


def test_flagged_speeds_equal_for_unflagged_ranks_by_hand():
    # Session 8's read of equal devices at 1.08, 1.0, 1.07 with the 2x rank at 1.87: the three
    # plan at 1.0, the straggler over their mean (1.08 + 1.0 + 1.07) / 3 = 1.05: 1.05 / 1.87.
    speeds = flagged_speeds((1.08, 1.0, 1.07, 1.87), (3,))
    assert speeds == pytest.approx((1.0, 1.0, 1.0, 1.05 / 1.87))
    # Two stragglers (the 4x phase), each over the mean of ranks 0 and 2 (1.02).
    speeds = flagged_speeds((1.0, 3.9, 1.04, 1.9), (1, 3))
    assert speeds == pytest.approx((1.0, 1.02 / 3.9, 1.0, 1.02 / 1.9))
    # No flag: even speeds, whatever the noise (a recovery plans the even widths).
    assert flagged_speeds((1.0, 1.22, 1.1, 1.0), ()) == (1.0, 1.0, 1.0, 1.0)
    # A flagged rank still under the others' mean (hysteresis) is planned at 1, never faster.
    assert flagged_speeds((1.3, 1.0, 1.3, 1.15), (3,)) == (1.0, 1.0, 1.0, 1.0)  # 1.2 / 1.15 > 1


def test_equal_devices_get_equal_widths_from_noisy_reads():
    """The planner at the flagged speeds splits the ffn equally over the three unflagged
    ranks (a proportional splitter stands in for the planner), where the raw reads gave the
    one read fastest 8% more."""

    def plan(speeds: tuple[float, ...]) -> dict[str, tuple[int, ...]]:
        total = sum(speeds)
        return {"ffn": tuple(round(1536 * v / total) for v in speeds)}

    raw = plan(tuple(1.0 / s for s in (1.08, 1.0, 1.07, 1.87)))["ffn"]
    assert raw[1] - raw[0] > 30  # 477 vs 441
    even = plan(flagged_speeds((1.08, 1.0, 1.07, 1.87), (3,)))["ffn"]
    assert even[0] == even[1] == even[2] and even[3] < even[0]


def test_model_times_by_hand():
    # ffn (84, 12) of 96, phi 0.2, speeds (1, 0.25): units 0.2 + 0.8 * 2 * 84 / 96 = 1.6 and
    # 0.2 + 0.8 * 2 * 12 / 96 = 0.4, the second at a quarter speed: 1.6.
    times = model_times((1.0, 0.25), {"ffn": (84, 12)}, 0.2)
    assert times == pytest.approx((1.6, 1.6))


def test_best_plan_balances_the_rest_when_one_floor_binds():
    """Three ranks, rank 2 at 0.1 speed keeps its floor (one head) in every candidate. A
    stand-in planner returns, at the phi-adjusted speeds, a lopsided split of the rest (the
    LP's tie); at the measured speeds an even one. Both have the same slowest rank, so the
    second-slowest decides: the even split wins."""
    speeds = (1.0, 1.0, 0.1)
    lopsided: dict[str, tuple[int, ...]] = {"heads": (6, 1, 1), "ffn": (90, 6, 0)}
    even: dict[str, tuple[int, ...]] = {"heads": (4, 3, 1), "ffn": (48, 48, 0)}
    adjusted = planning_speeds(speeds, 0.3)

    def planner(candidate: tuple[float, ...]) -> dict[str, tuple[int, ...]]:
        return lopsided if candidate == adjusted else even

    compute = {"heads": 1.0, "ffn": 2.0}
    widths, used = best_plan(planner, speeds, 0.3, compute)
    assert widths == even and used == speeds
    # The reference by hand: shares (heads 1/8 weighs 1 of 3, ffn 2 of 3) -> rank 2's
    # 1/24, units 0.3 + 0.7 * 3 / 24 at 0.1 speed = 3.875 in both; the others at 1.0:
    # lopsided rank 0 0.3 + 0.7 * 3 * (6/8/3 + 90/96 * 2/3) = 2.1375; even rank 0
    # 0.3 + 0.7 * 3 * (4/8/3 + 48/96 * 2/3) = 1.35 (rank 1 1.2625).
    slow = (0.3 + 0.7 * 3 / 24) / 0.1
    assert model_times(speeds, even, 0.3, compute)[2] == pytest.approx(slow)
    assert model_times(speeds, lopsided, 0.3, compute)[0] == pytest.approx(2.1375)
    assert max(model_times(speeds, even, 0.3, compute)[:2]) == pytest.approx(1.35)


def test_segment_time_by_hand_and_it_ranks_a_lopsided_split_last():
    """Two ranks at speeds (1, 0.5), phi 0.2, keys heads (weight 1) and ffn (weight 3). By
    hand, heads (1, 1): max(0.2 + 0.8, (0.2 + 0.8) / 0.5) = 2; ffn (60, 36) of 96:
    max(0.2 + 0.8 * 2 * 60 / 96, (0.2 + 0.8 * 2 * 36 / 96) / 0.5) = max(1.2, 1.6) = 1.6;
    the step 2 / 4 + 1.6 * 3 / 4 = 1.7.

    The bench's case (GPT-2, a 4.48x rank, phi 0.3287): the planner's lopsided split of the
    rest costs more in every layer than the balanced one, which best_plan picks."""
    widths = {"heads": (1, 1), "ffn": (60, 36)}
    compute = {"heads": 1.0, "ffn": 3.0}
    assert segment_time((1.0, 0.5), widths, 0.2, compute) == pytest.approx(1.7)
    speeds = (1.0, 1 / 4.48, 1 / 1.07, 1 / 1.99)
    weights = {"heads": 0.33, "ffn": 0.62, "vocab": 0.05}
    Split = dict[str, tuple[int, ...]]
    lopsided: Split = {"heads": (4, 1, 1, 2), "ffn": (1047, 0, 112, 377), "vocab": (174, 0, 19, 63)}
    balanced: Split = {"heads": (3, 1, 3, 1), "ffn": (653, 0, 652, 231), "vocab": (109, 0, 109, 38)}

    def by_hand(split: dict[str, tuple[int, ...]]) -> float:
        step = 0.0
        for key, counts in split.items():
            slowest = 0.0
            for count, speed in zip(counts, speeds, strict=True):
                units = 0.3287 + (1 - 0.3287) * 4 * count / sum(counts)
                slowest = max(slowest, units / speed)
            step += weights[key] * slowest
        return step

    for split in (lopsided, balanced):
        assert segment_time(speeds, split, 0.3287, weights) == pytest.approx(by_hand(split))
    assert by_hand(balanced) < by_hand(lopsided)

    def planner(candidate: tuple[float, ...]) -> dict[str, tuple[int, ...]]:
        return lopsided if candidate == tuple(speeds) else balanced

    # Since session 10 every key is re-split for its own slowest rank (``balanced_key``):
    # the result rates at most the balanced split's segment time.
    got = best_plan(planner, speeds, 0.3287, weights)[0]
    assert got == {k: balanced_key(v, speeds, 0.3287) for k, v in balanced.items()}
    assert by_hand(got) <= by_hand(balanced)


def test_balanced_key_by_hand():
    """Per key, the least slowest ``(phi + (1 - phi) n c / C) / v`` (greedy, exact)."""
    # Two ranks at (1, 0.25), phi 0.2, 96 columns: 0.2 + 1.6 c0 / 96 = 4 (0.2 + 1.6 c1 / 96)
    # at c1 = 12 (both 1.6); from any planner's split with a 0 or steps of 4.
    assert balanced_key((76, 20), (1.0, 0.25), 0.2) == (84, 12)
    # GPT-2's heads in the 4x phase, (1, 0.25, 1, 0.5), phi 0.39: a rank with h heads runs
    # 0.39 + 0.61 h / 2 at its speed; rank 1 at 0 heads already 1.56. Ranks 0 and 2 at 3
    # heads 1.305, rank 3 at 1 head 1.39, the eighth head to rank 0 (1.61; rank 3's second
    # 2.0, rank 1's first 2.78): (4, 0, 3, 1) from (3, 0, 3, 2) (a quiet s9 run's plan).
    assert balanced_key((3, 0, 3, 2), (1.0, 0.25, 1.0, 0.5), 0.39) == (4, 0, 3, 1)
    # No 0 in the planner's counts: one step each at least, (3, 1, 3, 1) (rank 1's second
    # head 4.0, rank 3's 2.0, ranks 0 and 2 at 3 heads 1.305).
    assert balanced_key((3, 2, 2, 1), (1.0, 0.25, 1.0, 0.5), 0.39) == (3, 1, 3, 1)
    # Steps of the gcd (32): (64, 32), rank 1 keeps its one step.
    assert balanced_key((64, 32), (1.0, 0.25), 0.2) == (64, 32)
    # A planner's one-rank split has gcd 8: one unit, to the lower of the fastest ranks; a
    # step given (best_plan takes the gcd over all its candidates) re-splits it as above.
    assert balanced_key((0, 0, 8, 0), (1.0, 0.25, 1.0, 0.5), 0.39) == (8, 0, 0, 0)
    assert balanced_key((0, 0, 8, 0), (1.0, 0.25, 1.0, 0.5), 0.39, 1) == (4, 0, 3, 1)

    def planner(candidate: tuple[float, ...]) -> dict[str, tuple[int, ...]]:
        return {"heads": (0, 0, 8, 0) if candidate[1] < 0.01 else (3, 0, 3, 2)}

    speeds = (1.0, 0.25, 1.0, 0.5)
    assert best_plan(planner, speeds, 0.39, {"heads": 1.0})[0] == {"heads": (4, 0, 3, 1)}


class _Proportional(_Cluster):
    """Rank 1 at 4x from step 6 to the end; the planner's stand-in splits ffn 96 in proportion
    to the speeds it is handed (what the real planner does with one width key)."""

    def slow(self, step: int) -> float:
        return 4.0 if step >= 6 else 1.0

    def plan(self, speeds: tuple[float, ...]) -> dict[str, tuple[int, ...]]:
        first = round(96 * speeds[0] / sum(speeds))
        return {"ffn": (first, 96 - first)}


def test_a_refitted_fixed_fraction_re_plans_toward_the_true_balance(monkeypatch: Any):
    """Configured phi 0, the cluster's 0.2, stable_tolerance 0.25 (the benchmark's). The
    first re-plan (at 4x, phi 0) gives rank 1 19 of 96 columns. By hand, equal times at phi
    0.2 need ``4 (0.2 + 0.8 * 2 f / 96) = 0.2 + 0.8 * 2 (96 - f) / 96``: f = 12.

    After the move the fit pulls phi half-way, to 0.1. At phi 0.1 the skewed widths read rank
    1 at (2.067 / 0.456) / (1.483 / 1.544) = 4.72x: measured speed 0.212 against the 0.25
    planned for, within 25% (the old check kept 19 columns). Its planning speed at phi 0.1,
    0.161, is off the 0.25 planned with by more than 0.25 * 0.25: the controller re-plans to
    round(96 * 0.161 / 1.161) = 13 columns. That move changes too few columns to fit phi
    again, and 13 stands."""
    cluster = _Proportional()
    controller = _controller(cluster, "replan", monkeypatch, fixed_fraction=0.0)
    controller.settings = replace(controller.settings, stable_tolerance=0.25)
    controller.detector = StragglerDetector(2, DetectorSettings(1.0, 0.15, 0.05, 0.25))
    _drive(controller, cluster, 40)
    assert cluster.moves == [{"ffn": (77, 19)}, {"ffn": (83, 13)}]
    assert controller.fixed_fraction == pytest.approx(0.1)
    assert abs(13 - 12) < abs(19 - 12)


def test_semi_moves_back_after_a_recovery_through_a_milder_slowdown(monkeypatch: Any):
    """The benchmark's knobs (every 2, threshold 0.3, release 0.1, stable_tolerance 0.25,
    stable_steps 2). Rank 1 at 4x for steps 6..29, 1.35x for 30..39, then 1x. SEMI re-plans
    the 4x, then the 1.35x (flagged, over 1.3). Then rank 1 reads 1.0: released, no rank is
    flagged, and SEMI's ops act on flagged ranks only (rank 0's 1.35x the time of rank 1 is
    its widths, not its device). The widths were planned for 1.35x, so SEMI re-plans as mode
    replan does: back to the even widths (before, it kept them to the end)."""
    cluster = _Proportional()
    stages = ((6, 4.0), (30, 1.35), (40, 1.0))

    def slow(step: int) -> float:
        return next((f for start, f in reversed(stages) if step >= start), 1.0)

    cluster.slow = slow  # type: ignore[method-assign]
    controller = _controller(cluster, "semi", monkeypatch)
    controller.settings = replace(
        controller.settings,
        every=2,
        threshold=0.3,
        release=0.1,
        stable_tolerance=0.25,
        stable_steps=2,
    )
    controller.detector = StragglerDetector(2, DetectorSettings(0.9, 0.3, 0.1, 0.25))
    _drive(controller, cluster, 60)
    # By hand at phi 0.2: 4x -> f = 12 (above); 1.35x -> planning speeds (1, 0.686) ->
    # round(96 * 0.686 / 1.686) = 39.
    assert cluster.moves == [{"ffn": (84, 12)}, {"ffn": (57, 39)}, EVEN]
    back = [r for r in controller.log.records if r["decision"].get("executed") == "replan"]
    assert back[-1]["step"] > 40 and not back[-1]["inputs"]["stragglers"]


def test_the_bench_calibration_fits_phi_from_its_two_width_phases():
    """``bench.dynamic_run.fixed_fraction_of_rows`` on rows made by the work model at phi 0.3
    (speeds 1, 1, 1, 0.8: the devices need not be equal; each keeps its speed): steps 1-7 at
    even widths, 9-15 at skewed ones, every rank's share moving by 0.25 or more. Steps 0 and 8
    (warm-ups) carry 10x times and must not count."""
    from colossal_hetero.balance.detector import shares_of, work_units
    from colossal_hetero.bench.dynamic_run import fixed_fraction_of_rows

    compute = {"heads": 1.0, "ffn": 2.0}
    even = {"heads": [2, 2, 2, 2], "ffn": [384, 384, 384, 384]}
    skew = {"heads": [3, 3, 1, 1], "ffn": [537, 537, 231, 231]}
    speeds = (1.0, 1.0, 1.0, 0.8)
    rows = []
    for step in range(16):
        units = work_units(shares_of(skew if step >= 8 else even, 4, compute), 0.3)
        slow = 10.0 if step in (0, 8) else 1.0
        row: list[float] = []
        for unit, speed in zip(units, speeds, strict=True):
            row += [1.0, 0.1 * slow * unit / speed, 0.0, 2.0]
        rows.append(row)
    assert fixed_fraction_of_rows(rows, [even, skew], compute, 4) == pytest.approx(0.3)


def test_held_speeds_keep_a_near_empty_straggler_from_reading_faster():
    # Rank 3 flagged at 4 * 0.02 = 0.08 of an even share (< 0.25): its reading 1/1.45 may
    # not raise the 1/1.95 it was planned at; a lower one (1/2.5) passes. Rank 1, flagged at
    # a full share, follows its reading; unflagged ranks stay at 1.
    shares = (0.33, 0.33, 0.32, 0.02)
    held = (1.0, 1.0, 1.0, 1 / 1.95)
    assert held_speeds((1.0, 1.0, 1.0, 1 / 1.45), held, shares, (3,))[3] == 1 / 1.95
    assert held_speeds((1.0, 1.0, 1.0, 1 / 2.5), held, shares, (3,))[3] == 1 / 2.5
    wide = (0.3, 0.2, 0.3, 0.2)  # 4 * 0.2 = 0.8: read as it is
    assert held_speeds((1.0, 0.6, 1.0, 0.7), (1.0, 0.5, 1.0, 0.5), wide, (1, 3)) == (
        1.0,
        0.6,
        1.0,
        0.7,
    )
    # Released (no flag): the reading counts; nothing held before the first plan.
    assert held_speeds((1.0, 1.0, 1.0, 1.0), held, shares, ()) == (1.0, 1.0, 1.0, 1.0)
    assert held_speeds((1.0, 0.7), None, (0.9, 0.1), (1,)) == (1.0, 0.7)


def test_reading_drops_record_the_slowest_reading_at_these_widths():
    # None (a caller's "not yet recorded") records nothing; then the slowest reading per rank
    # over the present one: 4.08 / 1.34 after GPT-2's 4x rank recovered (quiet s9).
    kept, drops = reading_drops(None, (1.0, 1.9))
    assert kept == {} and drops == (1.0, 1.0)
    kept, drops = reading_drops(kept, (1.0, 4.08))
    assert drops == (1.0, 1.0)
    kept, drops = reading_drops(kept, (1.02, 1.34))
    assert kept == {0: 1.02, 1: 4.08} and drops == pytest.approx((1.0, 4.08 / 1.34), rel=1e-12)


def test_measurable_slowdown_reads_against_the_loaded_ranks():
    # The quiet session-9 reading after GPT-2's 4x rank (1, no heads: 4 * 0.01 < 0.25)
    # recovered: against the least loaded reading 1.80 the others read 1.82 / 1.80 = 1.0111,
    # 1.0 and 2.95 / 1.80 = 1.6389; rank 1's 1.0 / 1.80 < 1 reads 1.
    shares = (0.37, 0.01, 0.37, 0.25)
    got = measurable_slowdown((1.82, 1.0, 1.80, 2.95), shares)
    assert got == pytest.approx((1.82 / 1.80, 1.0, 1.0, 2.95 / 1.80), rel=1e-12)
    # A near-empty rank reading slower keeps its reading over the reference (2.4 / 1.2 = 2);
    # loaded ranks only: the detector's vector over its least (here already 1).
    assert measurable_slowdown((1.2, 2.4, 1.3), (0.5, 0.02, 0.48)) == pytest.approx(
        (1.0, 2.0, 1.3 / 1.2), rel=1e-12
    )
    assert measurable_slowdown((1.0, 1.5), (0.6, 0.4)) == (1.0, 1.5)
    # Every rank near empty (no loaded reference): as read.
    assert measurable_slowdown((1.0, 1.7), (0.01, 0.01)) == (1.0, 1.7)


class _TwoX(_Proportional):
    """Rank 1 at 2x from step 3 on; the cluster's fixed fraction is 0.2."""

    def slow(self, step: int) -> float:
        return 2.0 if step >= 3 else 1.0


def _true_max(widths: Mapping[str, Sequence[int]]) -> float:
    first = widths["ffn"][0] / 96
    return max(0.2 + 0.8 * 2 * first, 2 * (0.2 + 0.8 * 2 * (1 - first)))


def test_a_near_empty_straggler_is_not_handed_back_work_on_a_lower_fit(monkeypatch: Any):
    """Configured phi 0.6 against the cluster's 0.2: the first re-plan gives the 2x rank
    round(96 * 0.091 / 1.091) = 8 columns (planning speeds (1, 0.091) by hand, ``n * share``
    0.17: near empty). The fit then pulls phi to 0.4, at which that rank reads 1.2x (still
    flagged: release 1.1); read as it is, its planning speed 0.74 would hand it 41 columns,
    a true step of 1.77 ms against 1.67 at 8 columns (read as it is, the moves are 8, 41,
    26). Held at 0.5, it is re-planned for the refitted phi alone: 21, then 28 at phi 0.2 (the
    median of 0.6 and two estimates of 0.2; by hand, planning speeds (1, 0.4118) at 0.2:
    round(96 x 0.4118 / 1.4118) = 28, the true balance), and no move makes the true step
    longer."""
    cluster = _TwoX()
    controller = _controller(cluster, "replan", monkeypatch, fixed_fraction=0.6)
    controller.settings = replace(controller.settings, stable_tolerance=0.25, threshold=0.3)
    controller.detector = StragglerDetector(2, DetectorSettings(1.0, 0.3, 0.1, 0.25))
    _drive(controller, cluster, 40)
    assert cluster.moves[0] == {"ffn": (88, 8)}
    steps = [_true_max(EVEN)] + [_true_max(m) for m in cluster.moves]
    assert all(b <= a + 1e-9 for a, b in zip(steps, steps[1:], strict=False)), cluster.moves
    assert [m["ffn"][1] for m in cluster.moves] == [8, 21, 28]
