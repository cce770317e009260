"""Gap fitting's pure parts: the gap model (moe/comm.py) and the alpha-beta fit (moe/profile.py),
against hand-computed values."""

from __future__ import annotations

import math

import pytest

from colossal_hetero.moe.comm import GapModel
from colossal_hetero.moe.profile import fit_alpha_beta


def test_gap_model_takes_the_shortest_recent_gap_and_inf_after_the_last_call() -> None:
    model = GapModel(history=2)
    assert model.gap_after(0) is None  # no history: nothing may go
    model.record([(0.0, 1.0), (3.0, 4.0), (4.5, 5.0)])  # gaps 2.0, 0.5
    model.record([(0.0, 1.0), (2.0, 2.5), (5.5, 6.0)])  # gaps 1.0, 3.0
    assert model.gap_after(0) == pytest.approx(1.0)
    assert model.gap_after(1) == pytest.approx(0.5)
    assert model.gap_after(2) == math.inf
    assert model.gap_after(3) is None
    model.record([(0.0, 1.0), (9.0, 9.5), (9.7, 9.8)])  # the first step falls out (history 2)
    assert model.gap_after(1) == pytest.approx(0.2)
    assert model.gap_after(0) == pytest.approx(1.0)
    model.record([(0.0, 1.0)])  # a different call count: only steps like the last one count
    assert model.gap_after(0) == math.inf
    model.record([])  # an empty step is ignored
    assert len(model.steps) == 2


def test_alpha_beta_fit_by_hand_and_noise_safe() -> None:
    alpha, beta = fit_alpha_beta((1000, 101000), (0.002, 0.003))  # 100000 B per ms
    assert beta == pytest.approx(1e8) and alpha == pytest.approx(0.00199)
    assert fit_alpha_beta((1000, 101000), (0.004, 0.003)) == (0.004, pytest.approx(101000 / 0.003))
    with pytest.raises(ValueError, match="increasing"):
        fit_alpha_beta((10, 10), (1.0, 2.0))
