"""The accuracy run's recipe and report (bench/dynamic_digits.py), pure: no ranks spawned.

Expected values are hand-computed from the fake runs below.
"""

from __future__ import annotations

import math

import pytest

from colossal_hetero.bench.dynamic_digits import DigitsCase, accuracy_report, digits_case, vit_model


def test_lr_schedule_warms_up_then_decays_to_zero():
    case = DigitsCase(model=vit_model(), steps=100, modes=(), lr=2e-3, warmup_fraction=0.1)
    assert case.lr_at(0) == pytest.approx(2e-4)  # 1/10 of the way up
    assert case.lr_at(9) == pytest.approx(2e-3)  # the peak at the last warm-up step
    assert case.lr_at(10) == pytest.approx(2e-3)  # cos(0): the decay starts at the peak
    assert case.lr_at(55) == pytest.approx(1e-3)  # half-way through the decay: cos(pi/2)
    last = 2e-3 * 0.5 * (1 + math.cos(math.pi * 89 / 90))
    assert case.lr_at(99) == pytest.approx(last) and last < 2e-3 * 1e-3  # ~0 at the end
    rates = [case.lr_at(s) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))  # monotone decay


def test_quick_and_full_cases():
    quick, full = digits_case(True, ("resize",)), digits_case(False, ("resize", "semi"))
    assert quick.steps < full.steps and len(quick.seeds) >= 2 and len(full.seeds) >= 3
    assert quick.first_seed_only == ("semi",) and full.first_seed_only == ()
    assert [p.factors[2] for p in quick.phases] == [1.0, 8.0, 1.0]  # rank 2 at 8x, middle half
    assert quick.phases[1].start == quick.steps // 4 and quick.phases[1].end == 3 * quick.steps // 4
    assert [v[0] for v in full.variants] == ["resize_unfrozen"]


def _run(accuracies: dict[str, float], losses: dict[str, float]) -> dict:
    return {
        "variants": {
            name: {
                "evals": [[10, 9.0, 0.0], [20, losses[name], acc]],
                "rows": [[0.1, 0, 0, 1.0]],
                "records": [],
            }
            for name, acc in accuracies.items()
        }
    }


def test_report_pairs_drops_by_seed_and_gives_the_spread():
    runs = [
        _run(
            {"unperturbed": 0.95, "resize": 0.94, "x": 0.96},
            {"unperturbed": 0.2, "resize": 0.25, "x": 0.2},
        ),
        _run(
            {"unperturbed": 0.97, "resize": 0.97, "x": 0.95},
            {"unperturbed": 0.1, "resize": 0.1, "x": 0.1},
        ),
    ]
    report = accuracy_report({"runs": runs, "seeds": [0, 1], "val_images": 360}, ["resize"])
    assert report["accuracy"]["unperturbed"] == pytest.approx(0.96)
    assert report["drop_by_seed"]["resize"] == pytest.approx([1.0, 0.0])
    assert report["drop_points"]["resize"] == pytest.approx(0.5)
    assert report["drop_by_seed"]["x"] == pytest.approx([-1.0, 2.0])  # an extra variant
    spread = report["drop_spread"]["x"]
    assert (spread["min"], spread["max"]) == pytest.approx((-1.0, 2.0))
    assert spread["std"] == pytest.approx(math.sqrt(4.5))  # sample std of (-1, 2)
    # t(0.975, 1 dof) = 12.706; half-width 12.706 * sqrt(4.5) / sqrt(2) = 12.706 * 1.5
    assert spread["ci95"] == pytest.approx([0.5 - 12.7062 * 1.5, 0.5 + 12.7062 * 1.5], rel=1e-4)
    assert report["val_loss_increase"]["resize"] == pytest.approx((0.25 + 0.0) / 2)
    assert report["curves"]["resize"][1][-1] == [20, 0.1, 0.97]


def test_report_pairs_a_first_seed_only_variant_with_its_own_seed():
    runs = [
        _run(
            {"unperturbed": 0.95, "resize": 0.94, "semi": 0.95},
            {"unperturbed": 0.2, "resize": 0.25, "semi": 0.2},
        ),
        _run({"unperturbed": 0.90, "resize": 0.89}, {"unperturbed": 0.3, "resize": 0.3}),
        _run({"unperturbed": 0.97, "resize": 0.98}, {"unperturbed": 0.1, "resize": 0.1}),
    ]
    result = {"runs": runs, "seeds": [4, 5, 6], "val_images": 360}
    report = accuracy_report(result, ["resize", "semi"])
    assert report["seeds_of"] == {"unperturbed": [4, 5, 6], "resize": [4, 5, 6], "semi": [4]}
    assert report["drop_by_seed"]["resize"] == pytest.approx([1.0, 1.0, -1.0])
    assert report["drop_points"]["resize"] == pytest.approx(1.0 / 3)
    assert report["drop_by_seed"]["semi"] == pytest.approx([0.0])
    assert report["drop_spread"]["semi"]["ci95"] == pytest.approx([0.0, 0.0])
    # sample std of (1, 1, -1): sqrt(((2/3)^2 * 2 + (4/3)^2) / 2) = sqrt(4/3); t(0.975, 2) = 4.3027
    half = 4.3027 * math.sqrt(4 / 3) / math.sqrt(3)
    ci = report["drop_spread"]["resize"]["ci95"]
    assert ci == pytest.approx([1 / 3 - half, 1 / 3 + half], rel=1e-4)
    assert report["accuracy"]["semi"] == pytest.approx(0.95)  # its one seed
    assert report["accuracy"]["unperturbed"] == pytest.approx((0.95 + 0.90 + 0.97) / 3)
    assert len(report["curves"]["semi"]) == 1 and len(report["curves"]["resize"]) == 3
