"""MeasuredGuard: the simulator's choice checked against measured step times, by hand.

The numbers follow one PP=4 run on free shaped links (milliseconds): the profile of a k = 3
step predicts k = 1 / 2 / 3 at 370 / 298 / 267, while k = 3 measured 330 and k = 2 266.
Margin 10%, explore 15%, memory 8 retunings, comparable within a factor 1.25.
"""

from __future__ import annotations

import pytest

from colossal_hetero.pipeline.measured import MeasuredGuard

AT_K3 = {1: 370.0, 2: 298.0, 3: 267.0}  # predicted from a k = 3 step
TO_K2 = {1: 370.0, 2: 230.0, 3: 267.0}  # a profile proposing k = 2
AT_K2 = {1: 318.0, 2: 234.0, 3: 218.0}  # predicted from a k = 2 step (it prefers k = 3 too)


def _guard() -> MeasuredGuard:
    return MeasuredGuard(margin=0.10, explore=0.15, memory=8)


def test_exploration_finds_the_measured_faster_neighbour_and_keeps_it():
    guard = _guard()
    # The simulator moves k = 1 to 3: nothing measured at 3, so it is followed.
    assert guard.choose(0, 1, 322.0, 3, AT_K3) == (3, "model")
    # It keeps 3; k = 2 is predicted 298 / 267 - 1 = 11.6% slower (within 15%), k = 4 does not
    # fit memory (not a candidate): k = 2 runs one period.
    assert guard.choose(1, 3, 330.0, 3, AT_K3) == (2, "explore")
    # k = 2 measured 266 < 330 * 0.9 = 297 (and 330 / 266 = 1.24 < 1.25): kept, though the
    # simulator proposes 3 again.
    assert guard.choose(2, 2, 266.0, 3, AT_K2) == (2, "explored-kept")
    # Later: 3 is proposed again and refuted by its recent 330 > 1.1 * 270 = 297.
    assert guard.choose(3, 2, 270.0, 3, AT_K2) == (2, "refuted")
    # k = 1 is predicted 318 / 234 - 1 = 35.9% slower: not explored; 3 is recent: kept.
    assert guard.choose(4, 2, 268.0, 2, AT_K2) == (2, "kept")


def test_an_exploration_that_does_not_pay_goes_back():
    guard = _guard()
    assert guard.choose(0, 3, 300.0, 3, AT_K3) == (2, "explore")
    # 285 is 5% faster, within the 10% margin (one step's noise): back to 3.
    assert guard.choose(1, 2, 285.0, 3, AT_K2) == (3, "explored-back")
    # k = 2 is recent now: no second exploration of it.
    assert guard.choose(2, 3, 301.0, 3, AT_K3) == (3, "kept")


def test_measurements_expire_after_memory_retunings():
    guard = _guard()
    assert guard.choose(0, 3, 300.0, 3, AT_K3) == (2, "explore")
    assert guard.choose(1, 2, 295.0, 3, AT_K2) == (3, "explored-back")
    for index in range(2, 9):  # k = 2's measurement (index 1) is recent through index 8
        assert guard.choose(index, 3, 300.0, 3, AT_K3) == (3, "kept")
    assert guard.choose(9, 3, 300.0, 3, AT_K3) == (2, "explore")


def _with_k2_at(index: int, seconds: float) -> MeasuredGuard:
    guard = _guard()
    guard.times[2] = (index, seconds, None)
    return guard


def test_a_switch_is_refuted_only_by_a_recent_comparable_slower_measurement():
    # The simulator proposes k = 2 at a gain beyond the margin: 267 / 230 - 1 = 16%.
    # Running k = 3 at 340: a proposed 2 measured 400 > 1.1 * 340 = 374 (ratio 1.18): refuted.
    assert _with_k2_at(0, 400.0).choose(1, 3, 340.0, 2, TO_K2) == (3, "refuted")
    # At 370: 400 <= 1.1 * 370 = 407, within the margin: followed.
    assert _with_k2_at(0, 400.0).choose(1, 3, 370.0, 2, TO_K2) == (2, "model")
    # The same 400 from 8 retunings before no longer counts.
    assert _with_k2_at(0, 400.0).choose(8, 3, 340.0, 2, TO_K2) == (2, "model")
    # At 300 the ratio is 1.33 >= 1.25: another condition (a tenant), not compared.
    assert _with_k2_at(0, 400.0).choose(1, 3, 300.0, 2, TO_K2) == (2, "model")


def test_an_exploration_across_a_change_of_conditions_is_inconclusive():
    under_tenant = {2: 620.0, 3: 600.0}
    guard = _guard()
    assert guard.choose(0, 3, 600.0, 3, under_tenant) == (2, "explore")
    # The tenant left during the explored period: 600 / 330 = 1.82, not compared: back to 3.
    assert guard.choose(1, 2, 330.0, 3, under_tenant) == (3, "explored-back")


def test_the_running_k_out_of_memory_is_never_kept():
    guard = _guard()
    guard.times[1] = (0, 500.0, None)
    fitting = {1: 370.0, 2: 298.0}  # k = 3 no longer fits the budget
    # 1 measured 500 > 1.1 * 450, yet 3 does not fit: the proposal stands.
    assert guard.choose(1, 3, 450.0, 1, fitting) == (1, "model")


def test_ties_explore_the_smaller_neighbour_and_bad_settings_are_refused():
    flat = {1: 100.0, 2: 100.0, 3: 100.0}
    assert _guard().choose(0, 2, 100.0, 2, flat) == (1, "explore")
    assert MeasuredGuard(0.1, explore=0.0).choose(0, 2, 100.0, 2, flat) == (1, "explore")
    slower = {1: 120.0, 2: 100.0, 3: 110.0}
    assert MeasuredGuard(0.1, explore=0.0).choose(0, 2, 100.0, 2, slower) == (2, "kept")
    with pytest.raises(ValueError, match="^memory:"):
        MeasuredGuard(0.1, 0.15, memory=1)
    with pytest.raises(ValueError, match="^margin, explore:"):
        MeasuredGuard(-0.01, 0.15)
    with pytest.raises(ValueError, match="^comparable, conditions:"):
        MeasuredGuard(0.1, 0.15, comparable=0.9)
    with pytest.raises(ValueError, match="^comparable, conditions:"):
        MeasuredGuard(0.1, 0.15, conditions=0.9)


def test_a_small_predicted_gain_the_measurements_did_not_show_is_refuted():
    # Session 9's idle PP=4 phase (a), per-step predictions from its records: the step at
    # k = 2 (269 ms) predicts k = 3 at 1.5% faster; k = 3 measured 270 the step before.
    small = {2: 261.0, 3: 257.0}  # 261 / 257 - 1 = 1.6% < 10%
    assert _with_k3_at(0, 270.0).choose(1, 2, 269.0, 3, small) == (2, "refuted")
    # Measured faster (265 < 269), the small gain is followed.
    assert _with_k3_at(0, 265.0).choose(1, 2, 269.0, 3, small) == (3, "model")
    # A gain beyond the margin (300 / 257 - 1 = 17%) is followed though 270 >= 269 ...
    large = {2: 300.0, 3: 257.0}
    assert _with_k3_at(0, 270.0).choose(1, 2, 269.0, 3, large) == (3, "model")
    # ... unless k = 3 measured more than 10% slower (300 > 1.1 * 269 = 295.9).
    assert _with_k3_at(0, 300.0).choose(1, 2, 269.0, 3, large) == (2, "refuted")


def _with_k3_at(index: int, seconds: float) -> MeasuredGuard:
    guard = _guard()
    guard.times[3] = (index, seconds, None)
    return guard


def test_a_measurement_under_conditions_the_profile_saw_change_is_not_compared():
    # Session 9's idle PP=4 phase (c) (seconds): the first step at k = 2 measured 1.122 and its
    # own profile predicted 1.149 for it; the profile of the explored k = 3 step (0.902)
    # predicts k = 2 and 3 alike at 0.900 / 0.898.
    first = {1: 1.152, 2: 1.149, 3: 1.147}
    after = {1: 0.905, 2: 0.900, 3: 0.898}
    window = {1: 2.057, 2: 2.049, 3: 2.045}  # the window's sums
    guard = _guard()
    # The simulator keeps 2; k = 3 is the neighbour predicted faster: it runs one period.
    assert guard.choose(1, 2, 1.122, 2, window, first) == (3, "explore")
    # 0.902 < 0.9 * 1.122 = 1.010 and 1.122 / 0.902 = 1.244 < 1.25, but k = 2 is predicted
    # 1.149 / 0.900 = 1.28 >= 1.15 apart: not comparable, back to k = 2.
    assert guard.choose(2, 3, 0.902, 3, window, after) == (2, "explored-back")
    # Without the profiles' predictions the measured ratio alone kept k = 3 (the old rule).
    guard = _guard()
    assert guard.choose(1, 2, 1.122, 2, window) == (3, "explore")
    assert guard.choose(2, 3, 0.902, 3, window) == (3, "explored-kept")
    # Predictions within 1.15 (1.149 / 1.05 = 1.094): comparable, k = 3 is kept.
    guard = _guard()
    assert guard.choose(1, 2, 1.122, 2, window, first) == (3, "explore")
    near = {1: 1.06, 2: 1.05, 3: 1.04}
    assert guard.choose(2, 3, 0.902, 3, window, near) == (3, "explored-kept")


def _settling() -> MeasuredGuard:
    return MeasuredGuard(margin=0.10, explore=0.15, memory=8, settle=3)


def test_no_exploration_before_the_running_k_has_settled():
    # settle 1 (the old guard): k = 2 is explored at the first retuning, from one step.
    assert _guard().choose(0, 3, 300.0, 3, AT_K3) == (2, "explore")
    guard = _settling()
    assert guard.choose(0, 3, 300.0, 3, AT_K3) == (3, "kept")
    assert guard.choose(1, 3, 310.0, 3, AT_K3) == (3, "kept")
    # Third step at k = 3 in a row, comparable: k = 2 runs one period.
    assert guard.choose(2, 3, 290.0, 3, AT_K3) == (2, "explore")
    assert guard.times[3] == (2, 300.0, None)  # the median of 300, 310, 290


def test_a_change_of_conditions_restarts_the_streak():
    guard = _settling()
    assert guard.choose(0, 3, 300.0, 3, AT_K3) == (3, "kept")
    assert guard.choose(1, 3, 300.0, 3, AT_K3) == (3, "kept")
    # A tenant: 600 / 300 = 2 >= 1.25, a new streak of one step (its own time, not a median).
    assert guard.choose(2, 3, 600.0, 3, AT_K3) == (3, "kept")
    assert guard.times[3] == (2, 600.0, None)
    assert guard.choose(3, 3, 620.0, 3, AT_K3) == (3, "kept")
    assert guard.choose(4, 3, 610.0, 3, AT_K3) == (2, "explore")
    # Its own prediction moving beyond ``conditions`` (1.15) restarts it too.
    guard = _settling()
    for index in range(2):
        assert guard.choose(index, 3, 300.0, 3, AT_K3, {3: 267.0}) == (3, "kept")
    assert guard.choose(2, 3, 300.0, 3, AT_K3, {3: 320.0}) == (3, "kept")  # 320 / 267 = 1.2


def test_an_exploration_is_judged_against_the_settled_median():
    # k = 3 ran 300, 300 and one stray 250 (the host let it run alone): the median is 300.
    # The explored k = 2 at 265 is 11.7% faster than 300, beyond the margin: kept. Judged
    # against the last step alone (250) it would go back: 265 >= 0.9 * 250.
    guard = _settling()
    for index, seconds in enumerate((300.0, 300.0)):
        assert guard.choose(index, 3, seconds, 3, AT_K3) == (3, "kept")
    assert guard.choose(2, 3, 250.0, 3, AT_K3) == (2, "explore")
    assert guard.choose(3, 2, 265.0, 3, AT_K2) == (2, "explored-kept")
    with pytest.raises(ValueError, match="^settle:"):
        MeasuredGuard(0.1, 0.15, settle=0)
