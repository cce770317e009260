"""Ratio rounding: invariants over many random cases (seeded), and the error cases."""

from __future__ import annotations

import numpy as np
import pytest

from colossal_hetero.planner.rounding import round_widths


def _random_case(rng: np.random.Generator):
    n = int(rng.integers(1, 10))
    granularity = int(rng.choice([1, 1, 8, 64, 96]))
    dim = int(rng.integers(0, 6000))
    if rng.random() < 0.5:
        dim -= dim % granularity  # head dims divide exactly
    ratios = rng.random(n) * (rng.random(n) < 0.8)  # some zero ratios
    if ratios.sum() == 0:
        ratios[int(rng.integers(n))] = 1.0
    caps = None
    if rng.random() < 0.3:
        caps = [int(c) for c in rng.integers(0, dim + 1, n)]
        caps[int(np.argmax(ratios))] = dim  # keep the case feasible
    return dim, ratios, granularity, caps


def test_rounding_invariants_hold_on_random_cases():
    rng = np.random.default_rng(2024)
    for _ in range(3000):
        dim, ratios, g, caps = _random_case(rng)
        widths = round_widths(dim, ratios, granularity=g, caps=caps)
        assert widths == round_widths(dim, list(ratios), granularity=g, caps=caps)  # deterministic
        assert len(widths) == len(ratios) and all(w >= 0 for w in widths)
        assert sum(widths) == dim
        leftover = dim % g
        off_grid = [d for d, w in enumerate(widths) if w % g]
        assert len(off_grid) <= 1
        if off_grid:
            assert (widths[off_grid[0]] - leftover) % g == 0
        if caps is not None:
            assert all(w <= c for w, c in zip(widths, caps, strict=True))
        ideal = np.asarray(ratios) / np.sum(ratios) * dim
        binding = caps is not None and any(
            ideal[d] > caps[d] - g - leftover for d in range(len(ratios))
        )
        if not binding:
            assert np.all(np.abs(np.asarray(widths) - ideal) < g + leftover), (dim, ratios, g)
            for d in np.flatnonzero(np.asarray(ratios) == 0):
                assert widths[d] == 0


def test_exact_bound_when_granularity_divides_dim():
    rng = np.random.default_rng(7)
    for _ in range(500):
        n, g = int(rng.integers(1, 8)), int(rng.choice([1, 64]))
        dim = g * int(rng.integers(0, 100))
        ratios = rng.random(n) + 1e-3
        widths = round_widths(dim, ratios, granularity=g)
        assert np.all(np.abs(np.asarray(widths) - ratios / ratios.sum() * dim) < g)


def test_equal_ratios_divisible_dim_give_equal_widths():
    assert round_widths(768, [1, 1, 1, 1], granularity=64) == (192, 192, 192, 192)
    assert round_widths(12, [0.25] * 4) == (3, 3, 3, 3)


def test_heads_are_whole_and_ties_go_to_lower_index():
    # 25 heads of 64 over 8 equal ranks: one rank gets 4 heads, the lowest index.
    widths = round_widths(25 * 64, [1] * 8, granularity=64)
    assert widths == (256,) + (192,) * 7


def test_zero_widths_and_leftover_elements():
    assert round_widths(10, [0, 1, 0]) == (0, 10, 0)
    # 50257 with alignment 64: one device takes the 17 leftover elements (largest ratio).
    widths = round_widths(50257, [1, 3], granularity=64)
    assert sum(widths) == 50257 and widths[1] % 64 == 17 and widths[0] % 64 == 0
    assert round_widths(0, [1, 2]) == (0, 0)


def test_caps_redistribute_in_proportion():
    widths = round_widths(100, [0.5, 0.25, 0.25], caps=[20, 100, 100])
    assert widths == (20, 40, 40)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dim": 10, "ratios": [0, 0]}, "all be zero"),
        ({"dim": 10, "ratios": [1, -1]}, ">= 0"),
        ({"dim": 10, "ratios": [1, float("nan")]}, "finite"),
        ({"dim": 10, "ratios": []}, "non-empty"),
        ({"dim": 100, "ratios": [1, 1], "caps": [10, 10]}, "caps hold 20"),
        ({"dim": 10, "ratios": [1], "granularity": 0}, "granularity >= 1"),
    ],
)
def test_bad_inputs_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        round_widths(**kwargs)


def test_minimum_units_hold_on_random_cases():
    """With ``min_units`` every device gets at least that many granules, even at ratio 0."""
    rng = np.random.default_rng(11)
    for _ in range(2000):
        n = int(rng.integers(1, 9))
        g = int(rng.choice([1, 2, 64]))
        least = int(rng.integers(1, 3))
        dim = g * int(rng.integers(least * n, least * n + 40))
        ratios = rng.random(n) * (rng.random(n) < 0.7)
        if ratios.sum() == 0:
            ratios[0] = 1.0
        widths = round_widths(dim, ratios, granularity=g, min_units=least)
        assert sum(widths) == dim and all(w % g == 0 for w in widths)
        assert min(widths) >= least * g, (dim, ratios, g, least)
        # Within one granule of the reference: x_d = max(least, lam * r_d) summing to the
        # units, with lam found by bisection (independent of the water-filling loop).
        units = dim // g
        lo_lam, hi_lam = 0.0, units / max(ratios.min(initial=1.0, where=ratios > 0), 1e-12)
        for _ in range(200):
            lam = (lo_lam + hi_lam) / 2
            if np.maximum(least, lam * ratios).sum() > units:
                hi_lam = lam
            else:
                lo_lam = lam
        reference = np.maximum(least, lo_lam * ratios)
        assert np.all(np.abs(np.asarray(widths) / g - reference) < 1 + 1e-6), (widths, reference)
    # Hand-worked: 3 groups of 2 heads over [1, 0.6, 0.3] at TP 3: every rank one group.
    assert round_widths(6, [1, 0.6, 0.3], granularity=2, min_units=1) == (2, 2, 2)
    # 12 heads in 6 groups, [1, 1, 0.1]: the slow rank's share 0.57 units rises to 1 group,
    # and the other two share the remaining 5 groups: 2.5 each, the tie to the lower index.
    assert round_widths(12, [1, 1, 0.1], granularity=2, min_units=1) == (6, 4, 2)
    assert round_widths(10, [0, 1, 0], min_units=1) == (1, 8, 1)


def test_minimum_errors_name_the_cause():
    with pytest.raises(ValueError, match="fewer than 1 for each of 4 devices"):
        round_widths(6, [1, 1, 1, 1], granularity=2, min_units=1)
    with pytest.raises(ValueError, match="device 1: its cap of 1 is below the minimum of 2"):
        round_widths(6, [1, 1], granularity=2, caps=[6, 1], min_units=1)
