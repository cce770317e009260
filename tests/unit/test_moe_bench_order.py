"""``bench moe``'s variant order (bench/moe_order.py): which twin runs first among its group,
counted by hand, and the re-ordering against a brute-force search over every order."""

from __future__ import annotations

from itertools import permutations

from colossal_hetero.bench.moe import WARMUP
from colossal_hetero.bench.moe_order import TWINS, balanced_order, first_counts, twin_leads

QUICK = [
    "stock",
    "stock_ep4",
    "ours_off",
    "ours_hold",
    "ours_on",
    "ours_pipe",
    "ours_pack",
    "ours_all",
    "ours_all_ep4",
    "deepspeed",
    "deepspeed_ep4",
]


def _spread(counts: dict[str, int]) -> int:
    return max(counts.values()) - min(counts.values())


def test_first_counts_by_hand() -> None:
    # Three names: rows 0, 1, 2 are a b c / b c a / c a b (then reversed for rows 3-5).
    assert first_counts(["a", "b", "c"], ["a", "b"], range(3)) == {"a": 2, "b": 1}
    # Rows 3-5 reversed: c b a / a c b / b a c.
    assert first_counts(["a", "b", "c"], ["a", "b"], range(3, 6)) == {"a": 1, "b": 2}


def test_balanced_order_reaches_the_brute_force_optimum() -> None:
    names = ["a", "b", "c", "d", "e", "f"]
    group = ["b", "c", "e"]
    cycle = range(1, 1 + 2 * len(names))
    best = min(_spread(first_counts(list(p), group, cycle)) for p in permutations(names))
    order = balanced_order(names, group, warmup=1)
    assert sorted(order) == sorted(names)
    assert [n for n in order if n in group] == group  # members keep their order
    assert [n for n in order if n not in group] == ["a", "d", "f"]
    assert _spread(first_counts(order, group, cycle)) == best


def test_the_bench_order_lets_no_twin_lead_more_often() -> None:
    twins = [n for n in QUICK if n in TWINS]
    cycle = range(WARMUP, WARMUP + 2 * len(QUICK))
    # The declared order: all on led its twins in 9 of 22 rounds, hold in 2 (session 10).
    assert first_counts(QUICK, twins, cycle) == {
        "ours_off": 7,
        "ours_hold": 2,
        "ours_on": 4,
        "ours_all": 9,
    }
    order = balanced_order(QUICK, TWINS, WARMUP)
    assert _spread(first_counts(order, twins, cycle)) <= 1
    # Fewer names in the group than two: unchanged.
    assert balanced_order(["a", "ours_hold", "b"], TWINS, WARMUP) == ["a", "ours_hold", "b"]


def test_twin_leads_by_hand() -> None:
    # Names a b c, group {a, b}; rounds from index 0: leaders a, b, a (test_first_counts_by_hand).
    series = {
        "a.step": [1.0, 5.0, 3.0],
        "a.cpu": [0.1, 0.5, 0.3],
        "b.step": [2.0, 4.0, 6.0],
        "c.step": [9.0, 9.0, 9.0],
    }
    leads = twin_leads(["a", "b", "c"], ["a", "b"], series, warmup=0)
    assert leads["a"] == {
        "led": 2,
        "step_led": 2.0,  # rounds 0 and 2: median of 1 and 3
        "step_not_led": 5.0,
        "cpu_led": 0.2,
        "cpu_not_led": 0.5,
    }
    assert leads["b"] == {
        "led": 1,
        "step_led": 4.0,
        "step_not_led": 4.0,  # rounds 0 and 2: median of 2 and 6
        "cpu_led": None,  # no cpu series
        "cpu_not_led": None,
    }
    assert "c" not in leads
