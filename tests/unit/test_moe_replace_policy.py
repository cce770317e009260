"""The re-placement decision (moe/replace_policy.py) against brute force, and its bad input."""

from __future__ import annotations

import itertools
import random

import pytest

from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.moe import MoeConfig
from colossal_hetero.config.parallel import ParallelConfig
from colossal_hetero.moe.checks import check_moe_layout
from colossal_hetero.moe.placement import even_placement
from colossal_hetero.moe.replace_policy import decide_placements, ep_capacity, ep_speeds


def _brute(loads: list[float], speeds: list[float], capacity: int) -> float:
    best = float("inf")
    for assign in itertools.product(range(len(speeds)), repeat=len(loads)):
        if any(assign.count(d) > capacity for d in range(len(speeds))):
            continue
        work = [0.0] * len(speeds)
        for e, d in enumerate(assign):
            work[d] += loads[e]
        best = min(best, max(w / s for w, s in zip(work, speeds, strict=True)))
    return best


def test_decision_is_the_optimum_per_layer_and_deterministic() -> None:
    rng = random.Random(7)
    speeds = [1.0, 1.0, 0.5, 0.5]
    for _ in range(6):
        loads = [[float(rng.randint(0, 100)) for _ in range(6)] for _ in range(2)]
        current = [even_placement(6, 3), even_placement(6, 3)]
        three = speeds[:3]
        new, record = decide_placements(loads, three, 3, current, min_gain=0.0)
        again, _ = decide_placements(loads, three, 3, current, min_gain=0.0)
        assert new == again
        for layer, placement in enumerate(new):
            best = _brute(loads[layer], three, 3)
            # min_gain 0: moves whenever strictly better, so the result is the optimum unless
            # the current placement already is one
            assert placement.max_work(loads[layer], three) == pytest.approx(best, rel=1e-12)
            assert max(len(placement.experts_on(d)) for d in range(3)) <= 3
        assert [x["layer"] for x in record["layers"]] == [0, 1]


def test_small_gains_do_not_move() -> None:
    loads = [[10.0, 10.0, 10.0, 11.0]]  # even: 20 vs 21 -> best 21 at best: no 10% gain
    current = [even_placement(4, 2)]
    new, record = decide_placements(loads, [1.0, 1.0], 2, current)
    assert new == current and not record["layers"][0]["moved"]
    hot = [[100.0, 100.0, 1.0, 1.0]]  # both hot experts on the slow rank 0
    new, record = decide_placements(hot, [0.5, 1.0], 4, current)
    assert new != current and record["layers"][0]["moved"]
    assert record["layers"][0]["max_work_after"] < record["layers"][0]["max_work_before"]


def test_speeds_capacity_and_bad_input() -> None:
    assert ep_speeds([1.0, 0.5, 1.0, 1.0], 2) == [1.0, 0.5]  # replicas: the slowest sets it
    assert ep_capacity(0, 8, 4) == 4 and ep_capacity(3, 8, 4) == 3 and ep_capacity(0, 4, 1) == 4
    with pytest.raises(ValueError, match="max_experts_per_rank"):
        ep_capacity(1, 8, 4)
    with pytest.raises(ValueError, match="multiple of ep"):
        ep_speeds([1.0, 1.0, 1.0], 2)
    with pytest.raises(ValueError, match="2 layers, 1 placements"):
        decide_placements([[1.0] * 4, [1.0] * 4], [1.0, 1.0], 2, [even_placement(4, 2)])


def test_config_errors_name_the_field() -> None:
    zero = ParallelConfig(ep=2, precision="bf16", zero_stage=1)
    check_moe_layout(zero, MoeConfig(replace_every=2), 4)  # ZeRO's slices move (replace_zero.py)
    with pytest.raises(ConfigError, match="moe.replace_every"):  # whole experts only, no tp
        check_moe_layout(ParallelConfig(ep=2, tp=2), MoeConfig(replace_every=2), 4)
    with pytest.raises(ConfigError, match="moe.packing"):
        check_moe_layout(ParallelConfig(ep=1), MoeConfig(packing=True), 4)
    with pytest.raises(ValueError, match="replace_every"):  # the loader adds "moe."
        MoeConfig(replace_every=-1)
    check_moe_layout(ParallelConfig(ep=2), MoeConfig(replace_every=2, packing=True), 4)
