"""In-layer plans (pure): amounts from the agreed slowdown against hand values and against
the ops' own balance equations (``kept_fraction``, ``migrated_fraction``)."""

from __future__ import annotations

import pytest

from colossal_hetero.balance.inlayer import (
    InLayerPlan,
    Offload,
    effective_slowdown,
    plan_offloads,
    plan_units,
    predicted_times,
)
from colossal_hetero.balance.ops.selection import kept_fraction, migrated_fraction

EVEN4 = (0.25, 0.25, 0.25, 0.25)


@pytest.mark.parametrize("phi", [0.0, 0.3])
@pytest.mark.parametrize("slow", [1.3, 2.0, 4.0])
def test_resize_amount_is_the_ops_kept_fraction(phi: float, slow: float):
    plan = plan_offloads(
        {1: "resize"}, (1.0, slow, 1.0, 1.0), EVEN4, fixed_fraction=phi, budget=0.9
    )
    expected = 1 - kept_fraction(slow, min_fraction=0.1, gemm_share=1 - phi)
    assert plan.of(1) == Offload(1, "resize", pytest.approx(expected), 0.0, slow)
    assert plan.helpers == ()
    # balanced: the straggler's time s * units equals the fast ranks' (when under budget)
    units = plan_units(plan, EVEN4, phi)
    if expected < 0.9:
        assert slow * units[1] == pytest.approx(units[0])


@pytest.mark.parametrize("phi", [0.0, 0.25])
@pytest.mark.parametrize("slow", [1.5, 4.0, 8.0])
def test_single_migration_is_the_ops_migrated_fraction(phi: float, slow: float):
    plan = plan_offloads(
        {2: "migrate"}, (1.0, 1.0, slow, 1.0), EVEN4, fixed_fraction=phi, budget=0.5
    )
    g = 1 - phi
    expected = (slow - 1) / (g * (slow + 1 / 3))  # migrated_fraction with gemm share g
    if phi == 0:
        assert expected == pytest.approx(migrated_fraction(slow, 3))
    assert plan.of(2) is not None and plan.of(2).migrated == pytest.approx(min(expected, 1.0))
    assert plan.helpers == (0, 1, 3)
    units = plan_units(plan, EVEN4, phi)
    if expected < 1:
        assert slow * units[2] == pytest.approx(units[0]) == pytest.approx(units[3])
    assert sum(units) == pytest.approx(4.0)  # migration moves work, it does not drop any


def test_two_migrating_stragglers_meet_the_helpers():
    """Ranks 1 (4x) and 3 (2x), helpers 0 and 2, phi 0: A = 2, B = 0.75, H = 2:
    T = (1 + 2 / 2) / (1 + 0.75 / 2) = 16 / 11; m1 = 1 - T / 4 = 7 / 11, m3 = 1 - T / 2 = 3 / 11.
    Helpers: 1 + (7 / 11 + 3 / 11) / 2 = 16 / 11."""
    plan = plan_offloads(
        {1: "migrate", 3: "migrate"}, (1.0, 4.0, 1.0, 2.0), EVEN4, fixed_fraction=0.0, budget=0.5
    )
    assert [(o.rank, o.migrated) for o in plan.offloads] == [
        (1, pytest.approx(7 / 11)),
        (3, pytest.approx(3 / 11)),
    ]
    assert plan.helpers == (0, 2)
    times = [s * u for s, u in zip((1.0, 4.0, 1.0, 2.0), plan_units(plan, EVEN4, 0.0), strict=True)]
    assert times == pytest.approx([16 / 11] * 4)


def test_migrate_plus_resize_and_mixed_and_degenerate():
    # migrate+resize: drops the budget, migrates the rest: 4x, 1 helper, phi 0, d = 0.5:
    # T = (1 + 0.5) / (1 + 0.25) = 1.2, m = 1 - 0.5 - 1.2 / 4 = 0.2
    plan = plan_offloads(
        {1: "migrate+resize"}, (1.0, 4.0), (0.5, 0.5), fixed_fraction=0.0, budget=0.5
    )
    assert plan.of(1) == Offload(1, "migrate+resize", 0.5, pytest.approx(0.2), 4.0)
    # a resize-only straggler beside a migrating one aims at the same T
    mixed = plan_offloads(
        {1: "migrate", 2: "resize"}, (1.0, 4.0, 1.25), (1 / 3,) * 3, fixed_fraction=0.0, budget=0.5
    )
    assert mixed.helpers == (0,)
    t = plan_units(mixed, (1 / 3,) * 3, 0.0)
    assert 4.0 * t[1] == pytest.approx(t[0])  # straggler and helper balanced
    assert 1.25 * t[2] <= t[0] + 1e-12  # the resized rank is no longer the slowest
    # nobody to migrate to: nothing; an unreachable target: capped at the budget
    assert plan_offloads(
        {0: "migrate", 1: "migrate"}, (2.0, 2.0), (0.5, 0.5), fixed_fraction=0.0, budget=0.5
    ).empty
    capped = plan_offloads({1: "resize"}, (1.0, 8.0), (0.5, 0.5), fixed_fraction=0.0, budget=0.3)
    assert capped.of(1).dropped == 0.3


def test_hysteresis_and_prediction():
    a = InLayerPlan((Offload(1, "resize", 0.5, 0.0, 4.0),))
    assert a.same_as(InLayerPlan((Offload(1, "resize", 0.45, 0.0, 4.3),)), 0.1)
    assert not a.same_as(InLayerPlan((Offload(1, "resize", 0.4, 0.0, 3.0),)), 0.1)
    assert not a.same_as(InLayerPlan((Offload(1, "migrate", 0.0, 0.5, 4.0),), (0,)), 0.1)
    assert InLayerPlan().same_as(InLayerPlan(), 0.1)
    # 1 ms and 4 ms at even shares, phi 0: resizing rank 1 by half -> 2 ms
    assert predicted_times((1e-3, 4e-3), InLayerPlan(), a, (0.5, 0.5), 0.0) == pytest.approx(
        (1e-3, 2e-3)
    )
    # and back: measured 2 ms under the plan -> 4 ms without it
    assert predicted_times((1e-3, 2e-3), a, InLayerPlan(), (0.5, 0.5), 0.0) == pytest.approx(
        (1e-3, 4e-3)
    )


def test_effective_slowdown_closes_the_loop_on_measured_times():
    """Resize at s = 4 attached; the detector's per-unit value is off (the model is wrong),
    the measured times decide: behind and capped -> keep 4; behind with room -> 4 x 2 = 8;
    ahead -> the lower of 4 x 0.5 = 2 and the detector's 10; far ahead -> released."""
    plan = InLayerPlan((Offload(1, "resize", 0.5, 0.0, 4.0),))
    kw = {"release": 0.05, "budget": 0.5}
    assert effective_slowdown(plan, (1.0, 10.0), (1,), (1.0, 2.0), **kw) == ((1.0, 4.0), (1,))
    room = {"release": 0.05, "budget": 0.9}
    assert effective_slowdown(plan, (1.0, 10.0), (1,), (1.0, 2.0), **room) == ((1.0, 8.0), (1,))
    assert effective_slowdown(plan, (1.0, 10.0), (1,), (1.0, 0.5), **kw) == ((1.0, 2.0), (1,))
    assert effective_slowdown(plan, (1.0, 3.0), (1,), (1.0, 0.2), **kw) == ((1.0, 1.0), ())
    # a rank without an offload keeps the detector's value and flag
    assert effective_slowdown(InLayerPlan(), (1.3, 1.0), (0,), (1.0, 1.0), **kw) == (
        (1.3, 1.0),
        (0,),
    )


def test_effective_slowdown_reference_is_no_new_straggler():
    """Rank 1 resized at s = 2 is level with rank 0; rank 2, flagged since (4x, no offload yet),
    is no reference: rank 1 keeps 2 and its flag (against rank 2's time it read 0.25x)."""
    plan = InLayerPlan((Offload(1, "resize", 0.3, 0.0, 2.0),))
    kw = {"release": 0.05, "budget": 0.5}
    out = effective_slowdown(plan, (1.0, 2.0, 4.0), (1, 2), (1.0, 1.0, 4.0), **kw)
    assert out == ((1.0, 2.0, 4.0), (1, 2))
    # with every other rank flagged, the slowest without an offload is the reference
    assert effective_slowdown(plan, (1.0, 2.0), (0, 1), (1.0, 1.0), **kw)[0] == (1.0, 2.0)


def test_effective_slowdown_follows_the_detectors_release():
    """Rank 1 resized at the cap (s = 4) lags the others by 10% (the ops' own overheads), but
    the detector, reading its time per unit of work under the ops, has released it (1.05):
    it is recovered, whatever the lag (it used to keep s = 4 and its ops)."""
    plan = InLayerPlan((Offload(1, "resize", 0.5, 0.0, 4.0),))
    kw = {"release": 0.1, "budget": 0.5}
    assert effective_slowdown(plan, (1.0, 1.05), (), (1.0, 1.1), **kw) == ((1.0, 1.05), ())
    # still flagged by the detector: the capped, lagging rank keeps its planned slowdown
    assert effective_slowdown(plan, (1.0, 1.2), (1,), (1.0, 1.1), **kw) == ((1.0, 4.0), (1,))
