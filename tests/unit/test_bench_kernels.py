"""bench kernels' pure parts: the width sweep, the affine fit, and one round of each variant."""

from __future__ import annotations

import math

import pytest
import torch

from colossal_hetero.bench.kernels import (
    TILE,
    KernelCase,
    _affine_fit,
    _resize_variants,
    _width_variants,
    _widths,
)


def test_every_ragged_width_has_its_aligned_neighbours():
    case = KernelCase(64, 4096, torch.float32, 1, 1.0)
    widths = _widths(case)
    assert widths == sorted(set(widths)) and 4096 // 4 in widths and widths[-1] == 4096
    ragged = [w for w in widths if w % TILE]
    assert ragged == [1032, 2056, 2088]
    for w in ragged:
        assert math.ceil(w / TILE) * TILE in widths and w // TILE * TILE in widths


def test_affine_fit_against_hand_values():
    a, b, worst = _affine_fit([1, 2, 3], [3.0, 5.0, 7.0])  # t = 1 + 2 w exactly
    assert a == pytest.approx(1.0) and b == pytest.approx(2.0) and worst == pytest.approx(0.0)
    # Least squares through (0, 1), (1, 3), (2, 2): b = 0.5, a = 1.5; the fit 1.5, 2, 2.5 is off
    # by 0.5 / 1, 1 / 3 and 0.5 / 2 relative to the times
    a, b, worst = _affine_fit([0, 1, 2], [1.0, 3.0, 2.0])
    assert a == pytest.approx(1.5) and b == pytest.approx(0.5)
    assert worst == pytest.approx(max(0.5 / 1.0, 1.0 / 3.0, 0.5 / 2.0))


def test_each_variant_runs_one_round_on_this_device():
    case = KernelCase(16, 128, torch.float32, 1, 1.0)
    device = torch.device("cpu")
    variants = {**_width_variants(case, device), **_resize_variants(case, device)}
    assert {"full", "kept0.25", "w32", "w128"} <= variants.keys()
    for variant in variants.values():
        assert variant(0, warmup=False) > 0.0
