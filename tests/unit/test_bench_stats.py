"""bench.stats and bench.rounds: interval coverage on seeded synthetic rounds, and the driver."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import numpy as np
import pytest

from colossal_hetero.bench.rounds import RoundsPolicy, round_order, run_rounds
from colossal_hetero.bench.stats import Interval, median_interval, ratio_interval

TRIALS = 400


def _rounds(rng: np.random.Generator, n: int, slowdown: float = 1.0) -> tuple[np.ndarray, ...]:
    """Step times of two variants over ``n`` interleaved rounds on a noisy shared machine.

    Per round a load factor both variants share (lognormal, sd 0.2), then each variant's own
    noise (lognormal, sd 0.05) and, one round in ten, a 1.5x spike of its own: the kinds of
    noise a loaded 2-core machine shows. ``b`` is ``slowdown`` times slower than ``a``.
    """
    load = np.exp(rng.normal(0.0, 0.2, n))

    def own() -> np.ndarray:
        return np.exp(rng.normal(0.0, 0.05, n)) * np.where(rng.random(n) < 0.1, 1.5, 1.0)

    return 0.3 * load * own(), 0.3 * slowdown * load * own()


def _ratio_through_driver(a: np.ndarray, b: np.ndarray, policy: RoundsPolicy) -> Interval:
    """b / a as run_rounds measures it: variant callables fed from the arrays, round by round."""
    result = run_rounds(
        {"a": lambda i, warmup: float(a[i]), "b": lambda i, warmup: float(b[i])},
        {"b_over_a": lambda v: v["b"] / v["a"]},
        policy,
    )
    assert result.figure_series["b_over_a"] == pytest.approx(
        list(b[: result.rounds] / a[: result.rounds])
    )
    return result.figures["b_over_a"]


@pytest.mark.parametrize("rounds", [10, 30])
def test_identical_variants_interval_covers_one(rounds):
    # Binomial margin: for an interval of true coverage 0.95, hits over 400 independent trials
    # are Binomial(400, 0.95): mean 380, sd sqrt(400 * 0.95 * 0.05) = 4.4. Requiring >= 372
    # (0.93) sits 1.8 sd below that mean, while an interval that undercovers at 0.90 would
    # have to beat its mean 360 by 2.0 sd of its own. These seeded trials measured 0.975
    # (390/400) at 10 and at 30 rounds.
    rng = np.random.default_rng(1234 + rounds)
    policy = RoundsPolicy(warmup=0, min_rounds=rounds, max_rounds=rounds, budget_s=1e9)
    hits = 0
    for _ in range(TRIALS):
        a, b = _rounds(rng, rounds)
        hits += _ratio_through_driver(a, b, policy).contains(1.0)
    assert hits >= 0.93 * TRIALS, f"covered 1.0 in {hits}/{TRIALS} trials"


def test_ten_percent_difference_is_detected():
    # The driver runs until the ratio is known to +-3%; then the interval must exclude 1.0
    # (a 10% gap is more than 3 half-widths) and contain the true 1.10 in >= 54 of 60 trials
    # (Binomial(60, 0.95) has mean 57 and sd 1.7; 54 sits 1.8 sd below). Measured: 57/60.
    rng = np.random.default_rng(7)
    policy = RoundsPolicy(warmup=0, min_rounds=10, max_rounds=400, budget_s=1e9)
    contains = 0
    for _ in range(60):
        a, b = _rounds(rng, policy.max_rounds, slowdown=1.10)
        interval = _ratio_through_driver(a, b, policy)
        assert interval.half_width <= 0.03
        assert not interval.contains(1.0), interval
        contains += interval.contains(1.10)
    assert contains >= 54, f"contained 1.10 in {contains}/60 trials"


def test_median_interval_contract():
    constant = median_interval([0.5] * 12)
    assert (constant.value, constant.low, constant.high, constant.half_width) == (
        0.5,
        0.5,
        0.5,
        0.0,
    )
    samples = [3.0, 1.0, 2.0, 5.0, 4.0]
    interval = median_interval(samples, seed=3)
    assert interval.value == 3.0  # hand-computed median
    assert interval.low <= 3.0 <= interval.high
    assert median_interval(samples, seed=3) == interval  # same seed, same numbers: same interval
    with pytest.raises(ValueError, match="need >= 2 samples"):
        median_interval([1.0])
    with pytest.raises(ValueError, match="must be > 0"):
        ratio_interval([1.0, 0.0, 2.0])
    assert Interval(2.0, 1.9, 2.2).half_width == pytest.approx(0.075)  # (2.2 - 1.9) / 2 / 2


def test_round_order_is_carryover_balanced():
    for n in range(1, 8):
        names = [str(i) for i in range(n)]
        period = n if n % 2 == 0 else 2 * n
        rows = [round_order(names, r) for r in range(period)]
        assert all(sorted(row) == names for row in rows)  # each round runs each variant once
        firsts = Counter(row[0] for row in rows)
        assert all(firsts[name] == period // n for name in names)
        pairs = Counter((a, b) for row in rows for a, b in zip(row, row[1:], strict=False))
        expected = {(a, b): period // n for a in names for b in names if a != b}
        assert dict(pairs) == expected  # every ordered neighbour pair equally often
    assert round_order(list("abcd"), 5) == round_order(list("abcd"), 1)  # period n for even n


def test_driver_balances_order_and_names_series():
    calls: list[tuple[str, int, bool]] = []

    def variant(name):
        def run(index, warmup):
            calls.append((name, index, warmup))
            return {"step": 1.0 + index, "compute": 0.5}

        return run

    policy = RoundsPolicy(warmup=1, min_rounds=3, max_rounds=3, budget_s=1e9)
    result = run_rounds({n: variant(n) for n in "xyz"}, {}, policy)
    assert [c[0] for c in calls] == list("xyzyzxzxyzyx")  # Williams rows 0-3
    assert [c[2] for c in calls] == [True] * 3 + [False] * 9
    assert result.rounds == 3 and result.stopped_by == "max_rounds"
    assert result.series["y.step"] == [2.0, 3.0, 4.0]  # warm-up round 0 not recorded
    assert sorted(result.series) == sorted(f"{n}.{k}" for n in "xyz" for k in ("step", "compute"))
    changing = {"x": lambda i, warmup: {"a": 1.0} if i == 1 else {"b": 1.0}}
    with pytest.raises(ValueError, match="round 2 measured"):
        run_rounds(changing, {}, policy)


def test_budget_stop_is_reported_with_the_half_width_reached():
    clock = itertools.count(0.0, 1.0)  # every clock reading is one second later
    ticks = iter(np.random.default_rng(0).lognormal(0.0, 0.3, 1000))  # far too noisy for 3%
    policy = RoundsPolicy(warmup=1, min_rounds=5, max_rounds=400, budget_s=20.0)
    result = run_rounds(
        {"a": lambda i, warmup: next(ticks), "b": lambda i, warmup: next(ticks)},
        {"b_over_a": lambda v: v["b"] / v["a"]},
        policy,
        clock=lambda: float(next(clock)),
    )
    # Clock readings: 0 at the start, then one per round from round 5: 1, 2, ... ; the 20th
    # reading (>= 20 s) comes after round 5 + 19 = 24.
    assert result.rounds == 24
    report = result.to_dict()
    assert report["stopped_by"] == "budget" and report["converged"] is False
    assert report["max_half_width"] == result.figures["b_over_a"].half_width > 0.03
    assert report["figures"]["b_over_a"]["ci"] == [
        result.figures["b_over_a"].low,
        result.figures["b_over_a"].high,
    ]


def test_decide_is_asked_once_per_round_and_has_the_last_word():
    asked: list[bool] = []

    def peer_says_stop_at_8(propose):
        asked.append(propose())  # what this rank would have decided
        return len(asked) == 8 - 4 + 1

    policy = RoundsPolicy(warmup=0, min_rounds=4, max_rounds=400, budget_s=1e9)
    result = run_rounds(
        {"a": lambda i, warmup: 1.0, "b": lambda i, warmup: 1.0},
        {"b_over_a": lambda v: v["b"] / v["a"]},
        policy,
        decide=peer_says_stop_at_8,
    )
    # Identical constant variants converge at once, yet the decision taken elsewhere rules:
    # asked after rounds 4..8, one question per round (the collective count is fixed).
    assert asked == [True] * 5 and result.rounds == 8
    assert result.figures["b_over_a"] == Interval(1.0, 1.0, 1.0)


def _static_case_result(case, stock, planned):
    """What run_case returns for ``case`` when every round measures the same times."""
    from colossal_hetero.bench import static

    def const(step, compute):
        return lambda i, warmup: {"step": step, "compute": compute}

    variants = {
        "homogeneous": const(1.0, 0.8),
        "stock": const(stock, 0.5),
        "planned": const(planned, 0.5),
    }
    policy = RoundsPolicy(warmup=0, min_rounds=3, budget_s=1e9)
    rounds = run_rounds(variants, static._figures(case), policy).to_dict()
    per_rank = {"step_time": 0.0, "compute_time": [], "comm_wait": [], "losses": []}
    return {
        "rounds": rounds,
        "plan": {"widths": None},
        "reference_tflops": 1.0,
        "layer_overhead_s": 0.0,
        "allreduce_gbps": 1.0,
        **{k: per_rank for k in ("homogeneous", "stock", "planned")},
    }


def test_static_figures_and_summary_keys():
    from colossal_hetero.bench import static

    by_name = {case.name: case for case in static.cases(quick=True)}
    hetero, other, equal = (
        by_name[n] for n in ("gpt2-tp2-[1,0.5]", "llama-tp2-[1,0.5]", "gpt2-tp2-equal")
    )
    rows = [
        static.summarise(hetero, _static_case_result(hetero, stock=2.0, planned=1.25)),
        static.summarise(other, _static_case_result(other, stock=2.0, planned=1.5)),
        static.summarise(equal, _static_case_result(equal, stock=1.0, planned=1.02)),
    ]
    # Hand-computed: speeds (1, 0.5) give n / sum(speeds) = 4/3, so
    # ideal = 1.0 - 0.8 + 0.8 * 4/3 = 19/15; equal speeds give ideal = T_homo = 1.0.
    ideal = 19 / 15
    assert rows[0]["ideal_step_time"] == pytest.approx(ideal, rel=1e-12)  # a few float ops
    assert rows[0]["speedup"] == pytest.approx(2.0 / 1.25, rel=1e-12)
    assert rows[0]["efficiency"] == pytest.approx(ideal / 1.25, rel=1e-12)
    assert rows[0]["efficiency_ci"] == [rows[0]["efficiency"]] * 2  # constant rounds
    summary = static.summary(rows)
    assert summary["worst_efficiency"] == pytest.approx(ideal / 1.5, rel=1e-12)
    assert summary["worst_efficiency_case"] == "llama-tp2-[1,0.5]"
    assert summary["worst_efficiency_ci"] == rows[1]["efficiency_ci"]
    assert summary["equal_speed_ratio"] == pytest.approx(1.0 / 1.02, rel=1e-12)
    assert summary["equal_speed_ratio_case"] == "gpt2-tp2-equal"
    assert summary["converged"] is True and summary["max_half_width"] == 0.0
    assert "equal_speed_ratio" not in static.summary(rows[:2])  # no equal-speed case run


def test_projected_budget_stops_before_a_round_would_overrun_it():
    # Each round takes 10 s (two variants of 5 s), the warm-up one too; budget 45 s. The values
    # vary, so the figure's interval never reaches the target width 0 (no convergence stop).
    now = [0.0]
    values = itertools.cycle([1.0, 1.5, 2.0])

    def five_seconds(index, *, warmup):
        now[0] += 5.0
        return next(values)

    variants = {"a": five_seconds, "b": five_seconds}
    figures = {"b_over_a": lambda v: v["b"] / v["a"]}
    policy = RoundsPolicy(
        warmup=1, min_rounds=2, max_rounds=10, budget_s=45.0, target_half_width=0.0, project=True
    )
    result = run_rounds(variants, figures, policy, clock=lambda: now[0])
    # After 3 rounds 40 s have gone (warm-up included), a 4th would end at 50 > 45: stop.
    assert result.rounds == 3 and now[0] == 40.0 and result.stopped_by == "budget"
    now[0] = 0.0
    plain = dataclasses.replace(policy, project=False)
    result = run_rounds(variants, figures, plain, clock=lambda: now[0])
    assert result.rounds == 4 and now[0] == 50.0  # the round under way finishes past it
