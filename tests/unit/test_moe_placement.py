"""Expert placement against brute force, the packing planner against hand counts, bad input.

Loads are integer token counts, so every device's sum of loads is exact in float64 and its
work (one division) is correctly rounded: solver and brute force agree bit for bit.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from colossal_hetero.moe import (
    Placement,
    a2a_sends,
    check_ep,
    check_routing,
    coselection,
    even_placement,
    exact_placement,
    greedy_placement,
    packing_aware_placement,
    packing_objective,
    place_experts,
    placement_from_groups,
)


def _brute_force(loads, speeds, caps) -> float:
    """min over all D^E assignments within capacity of the slowest device's work."""
    n_exp, n_dev = len(loads), len(speeds)
    assign = np.array(list(itertools.product(range(n_dev), repeat=n_exp)))  # [N, E]
    onehot = assign[:, :, None] == np.arange(n_dev)[None, None, :]  # [N, E, D]
    work = np.einsum("ned,e->nd", onehot.astype(float), np.asarray(loads, float)) / speeds
    ok = np.all(onehot.sum(axis=1) <= np.asarray(caps), axis=1)
    return float(work[ok].max(axis=1).min())


def _instances(count: int, max_experts: int = 8, max_devices: int = 4):
    rng = np.random.default_rng(11)
    for _ in range(count):
        n_exp = int(rng.integers(1, max_experts + 1))
        n_dev = int(rng.integers(1, max_devices + 1))
        loads = rng.integers(0, 30, n_exp).tolist()
        if rng.random() < 0.5:  # skewed: one hot expert
            loads[int(rng.integers(n_exp))] += 100
        speeds = rng.choice([0.5, 1.0, 2.0, 3.0], n_dev).tolist()
        caps = rng.integers(1, n_exp + 1, n_dev)
        while caps.sum() < n_exp:
            caps[int(rng.integers(n_dev))] += 1
        yield loads, speeds, caps.tolist()


def _valid(p: Placement, n_exp: int, caps) -> None:
    assert p.num_experts == n_exp
    for d, cap in enumerate(caps):
        assert len(p.experts_on(d)) <= cap


def test_exact_equals_brute_force_up_to_8_experts_4_devices():
    for loads, speeds, caps in _instances(40):
        p = exact_placement(loads, speeds, caps)
        _valid(p, len(loads), caps)
        assert p.max_work(loads, speeds) == _brute_force(loads, speeds, caps), (loads, speeds)


def test_exact_8_experts_4_devices_skewed_case():
    loads, speeds, caps = [90, 40, 30, 20, 10, 5, 3, 2], [1.0, 1.0, 0.5, 0.5], [3, 3, 2, 2]
    p = exact_placement(loads, speeds, caps)
    assert p.max_work(loads, speeds) == _brute_force(loads, speeds, caps)
    assert p.device_of[0] in (0, 1)  # the hot expert on a fast device
    # Even placement (2 per device, in order) puts 90+40 on device 0: 130; optimal is far below.
    assert even_placement(8, 4).max_work(loads, speeds) == 130.0
    assert p.max_work(loads, speeds) <= 100.0


def test_hot_expert_goes_to_the_fast_device_and_fast_devices_hold_more():
    # Speeds (3, 1), room for all: optimal puts 6 of the 8 unit-load experts on the fast one.
    p = exact_placement([1] * 8, [3.0, 1.0], 8)
    assert len(p.experts_on(0)) == 6 and p.max_work([1] * 8, [3.0, 1.0]) == 2.0
    p = exact_placement([10, 1, 1, 1], [2.0, 1.0], 3)
    assert p.device_of[0] == 0


def test_greedy_within_lpt_bound_without_capacity():
    for loads, speeds, _ in _instances(40, max_experts=7):
        n_dev = len(speeds)
        opt = _brute_force(loads, speeds, [len(loads)] * n_dev)
        got = greedy_placement(loads, speeds, len(loads)).max_work(loads, speeds)
        # Gonzalez-Ibarra-Sahni: LPT <= 2D/(D+1) OPT on uniform machines; 1e-12: float ratio.
        assert opt <= got <= 2 * n_dev / (n_dev + 1) * opt * (1 + 1e-12) + 1e-12


def test_greedy_scales_and_respects_capacity():
    rng = np.random.default_rng(3)
    loads = rng.integers(0, 1000, 256).tolist()
    speeds = [1.0] * 8 + [0.5] * 8
    caps = [24] * 8 + [8] * 8  # 256 slots: 3 experts per slow one's slot on the fast ones
    p = place_experts(loads, speeds, caps)  # auto: greedy above EXACT_MAX_EXPERTS
    _valid(p, 256, caps)
    assert sorted(p.device_of) == sorted(d for d in range(16) for _ in range(caps[d]))


def test_identical_input_identical_output_including_ties():
    args = ([5, 5, 5, 5, 3, 3], [1.0, 1.0, 1.0], 2)
    assert exact_placement(*args) == exact_placement(*args)
    assert greedy_placement(*args) == greedy_placement(*args)
    # Ties go to the lower device index: equal devices, equal experts -> round robin order.
    assert greedy_placement([1, 1, 1], [1.0, 1.0, 1.0], 1).device_of == (0, 1, 2)


def test_placement_record_and_groups_round_trip():
    p = placement_from_groups([[2, 0], [1], [3]], 4)
    assert p.device_of == (0, 1, 0, 2)
    assert p.record() == {"devices": [[0, 2], [1], [3]]}
    assert p.device_work([4, 1, 2, 8], [2.0, 1.0, 4.0]) == (3.0, 1.0, 2.0)


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([[0, 1], [3]], "expert 2 is placed on no device"),
        ([[0, 1, 2], [2, 3]], "expert 2 is placed twice"),
        ([[0, 1], [2, 3, 4]], "expert 4 on device 1 is not in"),
    ],
)
def test_placement_that_loses_or_duplicates_an_expert_is_an_error(groups, message):
    with pytest.raises(ValueError, match=message):
        placement_from_groups(groups, 4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((8, 3, 6), r"parallel.ep=3 does not divide the number of experts \(8\)"),
        ((8, 4, 6), r"parallel.ep=4 does not divide the world size \(6\)"),
        ((8, 0, 4), "parallel.ep must be >= 1"),
    ],
)
def test_ep_not_dividing_experts_or_world(args, message):
    with pytest.raises(ValueError, match=message):
        check_ep(*args)
    check_ep(8, 2, 4)  # a good one passes


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1, 2, 3], [1.0, 1.0], 1), "devices hold 2 experts, fewer than 3"),
        (([1, 2], [1.0, 0.0], 2), "speed of device 1 must be finite and > 0"),
        (([1, -2], [1.0], 2), "load of expert 1 must be finite and >= 0"),
        (([1, 2], [1.0, 1.0], [2]), "one value >= 0 per device"),
    ],
)
def test_bad_placement_inputs(args, message):
    for solver in (exact_placement, greedy_placement):
        with pytest.raises(ValueError, match=message):
            solver(*args)
    with pytest.raises(ValueError, match="method must be"):
        place_experts([1], [1.0], 1, method="ilp")  # type: ignore[arg-type]


# Packing. Placement: experts 0, 1 on device 0; experts 2, 3 on device 1.
TOPK = [[0, 1], [0, 2], [2, 3], [1, 3]]
HALVES = Placement((0, 0, 1, 1), 2)


def test_packing_counts_by_hand():
    # Devices per token: {0}, {0, 1}, {1}, {0, 1} -> 1 + 2 + 1 + 2 = 6 packed, 8 unpacked.
    counts = a2a_sends(TOPK, HALVES)
    assert (counts.unpacked, counts.packed, counts.saved) == (8, 6, 2)
    # Tokens start on devices 0, 1, 0, 1. Remote sends only:
    #   t0 -> (0, 0) from 0: 0 unpacked, 0 packed;  t1 -> (0, 1) from 1: 1, 1;
    #   t2 -> (1, 1) from 0: 2, 1;                  t3 -> (0, 1) from 1: 1, 1.
    counts = a2a_sends(TOPK, HALVES, token_device=[0, 1, 0, 1])
    assert (counts.unpacked, counts.packed) == (4, 3)
    # Every expert on its own device: packing saves nothing.
    assert a2a_sends(TOPK, Placement((0, 1, 2, 3), 4)).saved == 0


def test_coselection_and_k2_identity():
    c = coselection(TOPK, 4)
    expected = np.array([[2, 1, 1, 0], [1, 2, 0, 1], [1, 0, 2, 1], [0, 1, 1, 2]])
    np.testing.assert_array_equal(c, expected)
    rng = np.random.default_rng(5)
    topk = np.array([rng.choice(6, 2, replace=False) for _ in range(50)])
    cs = coselection(topk, 6)
    for device_of in itertools.product(range(3), repeat=6):
        p = Placement(device_of, 3)
        together = sum(
            cs[e, f] for e in range(6) for f in range(e + 1, 6) if device_of[e] == device_of[f]
        )
        assert a2a_sends(topk, p).packed == 2 * 50 - together


def test_packing_objective_by_hand():
    # Loads 2 each; device 0 (speed 2): 4 tokens * 0.5 s / 2 = 1.0 s; device 1 (speed 1): 2.0 s.
    # Packed sends 6 * 0.25 s = 1.5 s -> 3.5 s.
    assert packing_objective(HALVES, [2.0, 1.0], TOPK, 0.5, 0.25) == 3.5


@pytest.mark.parametrize(
    ("topk", "message"),
    [
        ([[0, 1, 2]], r"top_k=3 must be in \[1, num_experts=2\]"),
        ([[0, 0]], "same expert twice"),
        ([[0, 5]], "expert ids must be in"),
        ([0, 1], "must be \\[tokens, k\\]"),
    ],
)
def test_bad_routing(topk, message):
    with pytest.raises(ValueError, match=message):
        check_routing(topk, 2 if "top_k" in message else 4)


def test_packing_aware_placement_equals_brute_force():
    """Integer loads and dyadic costs (0.5, 0.25, 1.0): every objective is exact in float64."""
    rng = np.random.default_rng(17)
    for _ in range(12):
        n_exp, n_dev = int(rng.integers(2, 7)), int(rng.integers(1, 4))
        speeds = rng.choice([0.5, 1.0, 2.0], n_dev).tolist()
        caps = [n_exp] * n_dev if rng.random() < 0.5 else [-(-n_exp // n_dev)] * n_dev
        pairs = rng.integers(0, n_exp // 2, 40) * 2  # mostly co-selected pairs (0, 1), (2, 3)
        topk = np.stack([pairs, pairs + 1], axis=1)
        costs = (0.5, float(rng.choice([0.25, 1.0])))
        got = packing_aware_placement(speeds, caps, topk, n_exp, *costs)
        assert all(len(got.experts_on(d)) <= caps[d] for d in range(n_dev))
        brute = min(
            packing_objective(Placement(a, n_dev), speeds, topk, *costs)
            for a in itertools.product(range(n_dev), repeat=n_exp)
            if all(a.count(d) <= caps[d] for d in range(n_dev))
        )
        assert packing_objective(got, speeds, topk, *costs) == brute


def test_packing_aware_placement_keeps_co_selected_experts_together():
    # Tokens pick (0, 1) or (2, 3); two equal devices of 2 slots. Compute-only placements tie
    # (each device gets 2 experts of equal load); packing breaks the tie: {0, 1} and {2, 3}.
    topk = [[0, 1], [2, 3]] * 10
    p = packing_aware_placement([1.0, 1.0], 2, topk, 4, 0.5, 0.25)
    assert p.record() == {"devices": [[0, 1], [2, 3]]}
    assert a2a_sends(topk, p).packed == 20
