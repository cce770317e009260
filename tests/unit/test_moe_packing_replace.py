"""Packing-aware re-placement, pure half: the routing histogram, the decision against brute
force, hysteresis, determinism, the fallback searches and the measured costs."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from colossal_hetero.moe.packing import (
    Routing,
    local_search,
    packing_objective,
    packing_search,
    subset_index,
    subsets,
)
from colossal_hetero.moe.placement import Placement, even_placement, exact_placement
from colossal_hetero.moe.replace_packing import agree_costs, step_costs
from colossal_hetero.moe.replace_policy import PackingCosts, decide_packing_placements


def _histogram(topk: np.ndarray, source: np.ndarray, experts: int, ep: int) -> np.ndarray:
    k = topk.shape[1]
    counts = np.zeros((ep, math.comb(experts, k)), dtype=np.int64)
    np.add.at(counts, (source, subset_index(topk, experts)), 1)
    return counts


def _remote_sends(topk: np.ndarray, source: np.ndarray, device_of: tuple[int, ...]) -> int:
    """Brute force, token by token: the token's distinct ranks other than its own."""
    return sum(
        len({device_of[e] for e in row} - {src}) for row, src in zip(topk, source, strict=True)
    )


def test_subset_index_is_the_lexicographic_rank() -> None:
    for experts, k in [(4, 2), (6, 3), (8, 2), (8, 4), (5, 5), (5, 1)]:
        sets = list(itertools.combinations(range(experts), k))
        shuffled = np.array([list(reversed(s)) for s in sets])  # order inside a row is free
        assert subset_index(shuffled, experts).tolist() == list(range(len(sets)))
        assert subsets(experts, k).tolist() == [list(s) for s in sets]


@pytest.mark.parametrize("k", [2, 3])
def test_histogram_gives_the_packed_sends_exactly(k: int) -> None:
    """For any k the histogram's count equals the token-by-token count, for every placement;
    for k = 3 the pair counts would not (a token with three experts on one rank)."""
    rng = np.random.default_rng(k)
    experts, ep = 6, 3
    topk = np.array([rng.choice(experts, k, replace=False) for _ in range(200)])
    source = rng.integers(0, ep, 200)
    routing = Routing.from_histogram(_histogram(topk, source, experts, ep), experts, k)
    for device_of in itertools.product(range(ep), repeat=experts):
        got = routing.sends(Placement(device_of, ep))
        assert got.packed == _remote_sends(topk, source, device_of)
        assert got.unpacked == sum(
            device_of[e] != s for row, s in zip(topk, source, strict=True) for e in row
        )
    np.testing.assert_array_equal(routing.loads(), np.bincount(topk.ravel(), minlength=experts))


def _costs(spt: float, spb: float) -> PackingCosts:
    return PackingCosts(spt, spb, hidden=16, itemsize=4, ep=2, width=2)


def _brute(routing: Routing, speeds: list[float], capacity: int, costs: PackingCosts) -> float:
    return min(
        packing_objective(Placement(a, len(speeds)), speeds, routing, *_pair(costs))
        for a in itertools.product(range(len(speeds)), repeat=routing.num_experts)
        if all(a.count(d) <= capacity for d in range(len(speeds)))
    )


def _pair(costs: PackingCosts) -> tuple[float, float]:
    return costs.seconds_per_token, costs.seconds_per_send


def _pairs_routing(pairs: list[tuple[int, int]], tokens: int, ep: int, seed: int) -> Routing:
    """Tokens choose one of ``pairs`` (the obviously co-selected experts), from random ranks."""
    rng = np.random.default_rng(seed)
    topk = np.array([pairs[i] for i in rng.integers(0, len(pairs), tokens)])
    source = rng.integers(0, ep, tokens)
    return Routing.from_histogram(_histogram(topk, source, 4, ep), 4, 2)


@pytest.mark.parametrize("capacity", [2, 3, 4])
def test_decision_equals_brute_force(capacity: int) -> None:
    speeds_cases = ([1.0, 1.0], [1.0, 0.5])
    for seed, speeds in itertools.product(range(4), speeds_cases):
        routing = _pairs_routing([(0, 2), (1, 3), (0, 1)], 60, 2, seed)
        costs = _costs(1e-3, [1e-6, 1e-5, 1e-4][seed % 3])
        current = [even_placement(4, 2)]
        new, record = decide_packing_placements([routing], speeds, capacity, current, costs, 0.0)
        got = packing_objective(new[0], speeds, routing, *_pair(costs))
        assert got == pytest.approx(_brute(routing, speeds, capacity, costs), rel=1e-12)
        layer = record["layers"][0]
        assert layer["after"]["objective_s"] == pytest.approx(got, rel=1e-12)
        assert layer["after"]["packed_rows"] == routing.sends(new[0]).packed
        assert max(len(new[0].experts_on(d)) for d in range(2)) <= capacity
        again, record_again = decide_packing_placements(
            [routing], speeds, capacity, current, costs, 0.0
        )
        assert again == new and record_again == record  # identical inputs, identical output


def test_coselected_experts_end_up_together() -> None:
    # Equal loads: compute ties every 2 + 2 placement; only the sends choose {0,2} / {1,3}.
    topk = np.array([[0, 2], [1, 3]] * 20)
    source = np.array([0, 0, 1, 1] * 10)
    routing = Routing.from_histogram(_histogram(topk, source, 4, 2), 4, 2)
    new, record = decide_packing_placements(
        [routing], [1.0, 1.0], 2, [even_placement(4, 2)], _costs(1e-3, 1e-5)
    )
    assert sorted(sorted(g) for g in new[0].record()["devices"]) == [[0, 2], [1, 3]]
    layer = record["layers"][0]
    assert layer["before"]["packed_rows"] == 40 and layer["after"]["packed_rows"] == 20
    assert layer["after"]["packed_bytes"] == 20 * (2 * 16 + 2 * 2) * 4
    assert record["objective"] == "packing" and layer["moved"]


def test_hysteresis() -> None:
    topk = np.array([[0, 2], [1, 3]] * 20)
    source = np.array([0, 0, 1, 1] * 10)
    routing = Routing.from_histogram(_histogram(topk, source, 4, 2), 4, 2)
    current = [even_placement(4, 2)]
    # compute per rank 40 rows * 1 ms = 40 ms either way; sends 40 -> 20 (s_send = 2 * 144 *
    # spb / 2): the gain is 20 * s_send / (40 ms + 40 * s_send).
    for spb, moves in [(1e-6, False), (1e-5, True)]:
        costs = _costs(1e-3, spb)
        gain = 20 * costs.seconds_per_send / (0.04 + 40 * costs.seconds_per_send)
        assert (gain > 0.10) == moves
        new, record = decide_packing_placements([routing], [1.0, 1.0], 2, current, costs)
        assert record["layers"][0]["moved"] == moves and (new != current) == moves
        if not moves:
            assert record["layers"][0]["after"] == record["layers"][0]["before"]
    with pytest.raises(ValueError, match="2 layers, 1 placements"):
        decide_packing_placements([routing, routing], [1.0, 1.0], 2, current, _costs(1, 1))


def _is_local_optimum(p: Placement, speeds: list[float], cap: int, routing: Routing) -> bool:
    value = packing_objective(p, speeds, routing, 1.0, 0.5)
    n, devices = p.num_experts, p.num_devices
    for e, d in itertools.product(range(n), range(devices)):
        moved = list(p.device_of)
        moved[e] = d
        if (
            moved.count(d) <= cap
            and packing_objective(Placement(tuple(moved), devices), speeds, routing, 1.0, 0.5)
            < value
        ):
            return False
    for e, f in itertools.combinations(range(n), 2):
        swapped = list(p.device_of)
        swapped[e], swapped[f] = swapped[f], swapped[e]
        trial = Placement(tuple(swapped), devices)
        if packing_objective(trial, speeds, routing, 1.0, 0.5) < value:
            return False
    return True


def test_fallback_searches() -> None:
    rng = np.random.default_rng(3)
    experts, ep, cap = 10, 2, 6
    topk = np.array([rng.choice(experts, 2, replace=False) for _ in range(300)])
    routing = Routing.from_topk(topk, experts, rng.integers(0, ep, 300))
    speeds = [1.0, 0.5]
    choice = packing_search(speeds, cap, routing, 1.0, 0.5)
    assert choice.method == "local search"
    start = exact_placement(routing.loads().tolist(), speeds, cap)
    assert packing_objective(choice.placement, speeds, routing, 1.0, 0.5) <= packing_objective(
        start, speeds, routing, 1.0, 0.5
    )
    assert _is_local_optimum(choice.placement, speeds, cap, routing)
    assert packing_search(speeds, cap, routing, 1.0, 0.5) == choice
    small = Routing.from_topk(topk[:, :1] % 6, 6)  # top-1, 6 experts on 3 ranks
    stopped = packing_search([1.0, 1.0, 0.5], 2, small, 1.0, 0.5, max_nodes=5)
    assert stopped.method == "node budget"
    assert _is_local_optimum(stopped.placement, [1.0, 1.0, 0.5], 2, small)
    assert local_search(stopped.placement, [1.0, 1.0, 0.5], 2, small, 1.0, 0.5) == (
        stopped.placement
    )


def test_step_costs_by_hand() -> None:
    log = [
        ("pending", "ep", 0, 0.0, 10.0, 0),
        ("a2a", "ep", 1, 1.0, 2.0, 100),  # dispatch: 1 s
        ("a2a", "ep", 2, 5.0, 5.5, 50),  # combine: 0.5 s (the shortest); expert gap 3 s
        ("chunk", "dense", 0, 6.0, 7.0, 4096),  # gradient traffic: not an a2a
        ("pending", "ep", 3, 20.0, 30.0, 0),
        ("a2a", "ep", 4, 21.0, 23.0, 50),  # backward: 2 s
        ("a2a", "ep", 5, 25.0, 26.0, 100),  # expert gap 2 s
    ]
    expert, excess, nbytes = step_costs(log)
    assert (expert, excess, nbytes) == (5.0, 0.5 + 0.0 + 1.5 + 0.5, 300)
    costs = agree_costs([[5.0, 2.5, 300.0], [4.0, 1.0, 200.0], [1.0, 0.0, 0.0]], 20, 16, 4, 2, 2)
    assert costs is not None
    assert costs.seconds_per_token == 10.0 / 20 and costs.seconds_per_byte == 1.0 / 200
    assert costs.seconds_per_send == 2 * (2 * 16 + 2 * 2) * 4 * (1.0 / 200) / 2
    assert agree_costs([[0.0, 1.0, 10.0]], 20, 16, 4, 2, 2) is None  # no expert compute
    assert agree_costs([[1.0, 1.0, 0.0]], 20, 16, 4, 2, 2) is None  # no a2a bytes
    assert agree_costs([[1.0, 1.0, 10.0]], 0, 16, 4, 2, 2) is None  # nothing routed
