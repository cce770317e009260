"""Sharding-ratio LP: speed-proportional and uniform sanity cases, constant terms, memory."""

from __future__ import annotations

import numpy as np
import pytest

from colossal_hetero.planner.affine import Affine, concat
from colossal_hetero.planner.lp import min_overflow, minimize_max_sum
from tests.tolerances import LP_ATOL


def _compute_rows(work: float, speeds: list[float], const: list[float] | None = None) -> Affine:
    """Device d computes ``work * x_d / speed_d`` (+ a constant of its own)."""
    n = len(speeds)
    rows = Affine.select(n, range(n), scale=work / np.asarray(speeds))
    return rows if const is None else rows + np.asarray(const)


@pytest.mark.parametrize("speeds", [[1.0, 0.5], [4.0, 1.0, 2.0, 0.25], [3.0, 3.0, 1.0]])
def test_compute_only_ratios_are_proportional_to_speed(speeds):
    n = len(speeds)
    res = minimize_max_sum([(_compute_rows(6.0, speeds), 1.0)], num_vars=n, simplices=[range(n)])
    np.testing.assert_allclose(res.x, np.asarray(speeds) / sum(speeds), atol=LP_ATOL)
    assert res.objective == pytest.approx(6.0 / sum(speeds), rel=1e-6)  # HiGHS: 1e-7 gap
    assert res.x.sum() == pytest.approx(1.0, abs=LP_ATOL) and np.all(res.x >= 0)


def test_equal_devices_give_uniform_ratios():
    res = minimize_max_sum(
        [(_compute_rows(1.0, [2.0] * 5), 1.0), (_compute_rows(3.0, [2.0] * 5), 2.0)],
        num_vars=5,
        simplices=[range(5)],
    )
    np.testing.assert_allclose(res.x, 0.2, atol=LP_ATOL)


def test_constant_terms_are_kept_two_device_hand_case():
    """Speeds (2, 1); work F = 1 split by x; a replicated part G = 0.5 (G / speed per device);
    a padded all-gather costing 0.3 * max(x) and an all-reduce costing 0.1 (both constant in
    the choice of device). By hand (see below) the optimum is x = (5/6, 1/6), T = 61/60.

    For x0 >= 1/2: T = max(x0/2 + 1/4, (1 - x0) + 1/2) + 0.3 x0 + 0.1. The max decreases until
    the rows meet at x0 = 5/6, after which T increases, so T* = 1.5 - 5/6 + 0.25 + 0.1 = 61/60.
    Dropping the constants (HAP's code) would give x0 = 2/3, where T = 5/6 + 0.2 + 0.1."""
    compute = _compute_rows(1.0, [2.0, 1.0], const=[0.25, 0.5])
    gather = Affine.select(2, [0, 1], scale=0.3)  # padded: every rank waits for the largest shard
    allreduce = np.array([0.1, 0.1])
    terms = [(compute, 1.0), (gather, 1.0), (allreduce, 1.0)]
    res = minimize_max_sum(terms, num_vars=2, simplices=[[0, 1]])
    np.testing.assert_allclose(res.x, [5 / 6, 1 / 6], atol=LP_ATOL)
    assert res.objective == pytest.approx(61 / 60, rel=1e-6)  # HiGHS: 1e-7 gap

    dropped = minimize_max_sum(
        [(_compute_rows(1.0, [2.0, 1.0]), 1.0), (gather, 1.0)], num_vars=2, simplices=[[0, 1]]
    )
    np.testing.assert_allclose(dropped.x, [2 / 3, 1 / 3], atol=LP_ATOL)
    at_dropped = sum(float(np.max(Affine.value(r, dropped.x))) for r, _ in terms[:2]) + 0.1
    assert at_dropped == pytest.approx(5 / 6 + 0.3, rel=1e-6)  # HiGHS: 1e-7 gap
    assert res.objective < at_dropped


def test_objective_not_worse_than_proportional_start():
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(2, 6))
        speeds = list(rng.uniform(0.2, 2.0, n))
        terms = [
            (_compute_rows(1.0, speeds, const=list(rng.uniform(0, 0.3, n))), 1.0),
            (Affine.select(n, range(n), scale=rng.uniform(0, 0.5)), 1.0),
        ]
        res = minimize_max_sum(terms, num_vars=n, simplices=[range(n)])
        start = np.asarray(speeds) / sum(speeds)
        at_start = sum(w * float(np.max(r.value(start))) for r, w in terms)
        assert res.objective <= at_start + 1e-9


def test_padded_gather_pulls_ratios_toward_uniform():
    """O-L5: a dominant padded all-gather (cost ~ max_d x_d) moves the split toward uniform."""
    speeds = [4.0, 1.0]
    compute = (_compute_rows(1.0, speeds), 1.0)
    light = minimize_max_sum([compute], num_vars=2, simplices=[[0, 1]])
    heavy = minimize_max_sum(
        [compute, (Affine.select(2, [0, 1], scale=10.0), 1.0)], num_vars=2, simplices=[[0, 1]]
    )
    assert abs(heavy.x[0] - 0.5) < abs(light.x[0] - 0.5)


def test_memory_limit_binds_and_infeasible_returns_none():
    speeds = [3.0, 1.0]
    memory = Affine.select(2, [0, 1], scale=10.0)  # bytes grow with the share
    terms = [(_compute_rows(1.0, speeds), 1.0)]
    res = minimize_max_sum(terms, num_vars=2, simplices=[[0, 1]], limits=[(memory, [6.0, 6.0])])
    np.testing.assert_allclose(res.x, [0.6, 0.4], atol=LP_ATOL)
    assert minimize_max_sum(terms, num_vars=2, simplices=[[0, 1]], limits=[(memory, 4.0)]) is None


def test_unused_simplex_keeps_its_start_value():
    rows = Affine.select(4, [0, 1], scale=[1.0, 1.0])
    res = minimize_max_sum(
        [(rows, 1.0)], num_vars=4, simplices=[[0, 1], [2, 3]], x0=np.array([0.5, 0.5, 0.9, 0.1])
    )
    np.testing.assert_allclose(res.x[2:], [0.9, 0.1], atol=LP_ATOL)


def test_min_overflow_names_the_tightest_row():
    memory = concat([Affine.select(2, [0, 1], scale=10.0) + np.array([5.0, 0.0])])
    x, usage = min_overflow([(memory, np.array([6.0, 6.0]))], num_vars=2, simplices=[[0, 1]])
    assert usage.max() > 1 and x.sum() == pytest.approx(1.0, abs=LP_ATOL)
