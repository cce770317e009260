"""Speed-aware stage split vs brute force and Colossal-AI's even split; micro-batch choice."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest

from colossal_hetero.pipeline.simulator import Trace, simulate
from colossal_hetero.pipeline.validate import check_layers_per_stage
from colossal_hetero.planner.stages import (
    PipelineCosts,
    StageTimes,
    affine_block_seconds,
    choose_microbatches,
    near_best_splits,
    remainder_priority,
    split_from_times,
    split_layers,
    stage_speeds,
)


def colossalai_even_split(num_layers: int, num_stages: int) -> list[int]:
    from colossalai.pipeline.stage_manager import PipelineStageManager

    manager = SimpleNamespace(num_layers_per_stage=None, num_stages=num_stages, num_model_chunks=1)
    return PipelineStageManager.distribute_layers(manager, num_layers)  # type: ignore[arg-type]


def compositions(total: int, parts: int, caps: list[int]):
    if parts == 1:
        if 1 <= total <= caps[0]:
            yield (total,)
        return
    for first in range(1, min(caps[0], total - parts + 1) + 1):
        for rest in compositions(total - first, parts - 1, caps[1:]):
            yield (first, *rest)


def stage_time(n, speed, layer_s, extra):
    return n * layer_s / speed + extra


def test_equal_devices_give_colossalai_even_split():
    for p in range(1, 9):
        for layers in range(p, 41):
            want = colossalai_even_split(layers, p)
            assert split_layers(layers, [3.0] * p) == want, (layers, p)
            assert split_layers(layers, [1.0] * p, extra_seconds=[0.5] * p) == want


def test_remainder_priority_is_nested_runs_of_middle_stages():
    assert remainder_priority(4) == [2, 1, 3, 0]
    assert remainder_priority(6) == [3, 2, 4, 1, 5, 0]
    assert sorted(remainder_priority(7)) == list(range(7))


def test_matches_brute_force():
    rng = random.Random(5)
    for _ in range(150):
        p = rng.randint(1, 4)
        layers = rng.randint(p, 12)
        speeds = [rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]) for _ in range(p)]
        extra = [rng.choice([0.0, 0.0, 0.7, 1.3]) for _ in range(p)]
        mem = [rng.choice([2.0, 4.0, 6.0, 100.0]) for _ in range(p)] if rng.random() < 0.5 else None
        caps = [int(m) if mem else layers for m in (mem or [0] * p)]
        feasible = list(compositions(layers, p, caps))
        kwargs = dict(layer_seconds=0.3, extra_seconds=extra, memory_bytes=mem, layer_bytes=1.0)
        if not feasible:
            with pytest.raises(ValueError, match="^memory_bytes:"):
                split_layers(layers, speeds, **kwargs)
            continue
        best = min(
            max(stage_time(n, v, 0.3, e) for n, v, e in zip(c, speeds, extra, strict=True))
            for c in feasible
        )
        got = split_layers(layers, speeds, **kwargs)
        assert sum(got) == layers and all(1 <= n <= c for n, c in zip(got, caps, strict=True))
        # Same float expression on both sides: the optimum is reached exactly.
        times = [stage_time(n, v, 0.3, e) for n, v, e in zip(got, speeds, extra, strict=True)]
        assert max(times) == best


def test_speed_proportional_when_divisible():
    assert split_layers(12, [2.0, 1.0, 1.0]) == [6, 3, 3]
    assert split_layers(12, [1.0, 0.5]) == [8, 4]
    # The stage with the LM head (extra time) gets fewer layers.
    assert split_layers(12, [1.0, 1.0], extra_seconds=[0.0, 2.0]) == [7, 5]


def test_stage_speeds_layout():
    # dp=2 x pp=2 x tp=2, rank (d*pp + s)*tp + t.
    speeds = [1.0, 2.0, 4.0, 4.0, 1.0, 1.0, 3.0, 5.0]
    assert stage_speeds(speeds, pp=2, tp=2, dp=2) == [2.0, 8.0]
    with pytest.raises(ValueError, match="^cluster.speeds:"):
        stage_speeds(speeds, pp=2, tp=2, dp=1)


@pytest.mark.parametrize(
    "split, match",
    [([3, 3], "sums to 6"), ([8], "1 entries for 2"), ([0, 8], "needs a layer")],
)
def test_bad_explicit_split(split, match):
    with pytest.raises(ValueError, match=f"^parallel.num_layers_per_stage: .*{match}"):
        check_layers_per_stage(split, 8, 2)


def test_bad_split_inputs():
    with pytest.raises(ValueError, match="^num_layers:"):
        split_layers(2, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="^speeds:"):
        split_layers(4, [1.0, 0.0])
    check_layers_per_stage([4, 4], 8, 2)


def brute_force_microbatches(costs: PipelineCosts, batch: int) -> tuple[int, int]:
    p = len(costs.forward_s_per_sample)
    best = None
    for m, k in itertools.product(range(p, batch + 1), range(1, batch + 1)):
        if batch % m or k > m:
            continue
        n = batch // m
        peaks = [min(k * (p - s), m) for s in range(p)]
        act = [n * a for a in costs.activation_bytes_per_sample]
        if any(x * a > b for x, a, b in zip(peaks, act, costs.memory_budget_bytes, strict=True)):
            continue
        o = costs.pass_overhead_s
        t = simulate(
            [n * f + o for f in costs.forward_s_per_sample],
            [n * b + o for b in costs.backward_s_per_sample],
            [Trace.constant(n * c) for c in costs.link_s_per_sample],
            m,
            k,
            latency_s=costs.latency_s or None,
        ).step_time
        if best is None or t < best[0] * (1 - 1e-9):
            best = (t, m, k)
    assert best is not None
    return best[1], best[2]


def test_microbatch_choice_matches_brute_force():
    rng = random.Random(2)
    for _ in range(12):
        p = rng.randint(2, 3)
        costs = PipelineCosts(
            forward_s_per_sample=tuple(rng.uniform(0.5, 1.5) for _ in range(p)),
            backward_s_per_sample=tuple(rng.uniform(1.0, 3.0) for _ in range(p)),
            activation_bytes_per_sample=(1.0,) * p,
            memory_budget_bytes=tuple(rng.uniform(12.0, 40.0) for _ in range(p)),
            link_s_per_sample=tuple(rng.uniform(0.0, 0.5) for _ in range(p - 1)),
            latency_s=tuple(rng.uniform(0.0, 4.0) for _ in range(p - 1)),
            pass_overhead_s=rng.uniform(0.0, 2.0),
        )
        choice = choose_microbatches(costs, 12)
        assert (choice.num_microbatches, choice.decision.k) == brute_force_microbatches(costs, 12)


def test_microbatch_choice_extremes():
    base = dict(
        forward_s_per_sample=(1.0, 1.0),
        backward_s_per_sample=(2.0, 2.0),
        activation_bytes_per_sample=(1.0, 1.0),
        memory_budget_bytes=(1e9, 1e9),
        link_s_per_sample=(0.0,),
    )
    # No overhead: (m + p - 1) / m * B * (f + b) falls with m, so the most micro-batches win.
    assert choose_microbatches(PipelineCosts(**base), 16).num_microbatches == 16
    # Huge per-pass overhead: as few passes as Colossal-AI allows (m = p).
    slow_passes = PipelineCosts(**base, pass_overhead_s=100.0)
    assert choose_microbatches(slow_passes, 16).num_microbatches == 2
    # Memory: stage 0 holds min(k * 2, m) micro-batches of 16 / m samples; a 10-byte budget
    # rules out m = 2 (2 x 8 samples) and keeps m = 4 only with k = 1 (2 x 4 samples).
    tight = dict(base, memory_budget_bytes=(10.0, 10.0))
    choice = choose_microbatches(PipelineCosts(**tight, pass_overhead_s=100.0), 16)
    assert choice.num_microbatches == 4 and choice.decision.k == 1
    with pytest.raises(ValueError, match="^data.global_batch_size:"):
        choose_microbatches(PipelineCosts(**dict(base, memory_budget_bytes=(0.5, 0.5))), 16)


def test_measured_times_match_brute_force():
    """The split from measured affine stage times against every composition; the relative
    slack 1e-12 covers the two roundings of 1 / (1 / b) (a few ulps)."""
    rng = random.Random(11)
    for _ in range(200):
        p = rng.randint(1, 5)
        layers = rng.randint(p, 13)
        block = tuple(rng.choice([0.011, 0.0145, 0.02, 0.007]) for _ in range(p))
        fixed = tuple(rng.choice([0.0, 0.002, 0.009]) for _ in range(p))
        times = StageTimes(block, fixed)
        best = min(max(times.stage_seconds(c)) for c in compositions(layers, p, [layers] * p))
        got = split_from_times(layers, times)
        assert sum(got) == layers and min(got) >= 1
        assert max(times.stage_seconds(got)) <= best * (1 + 1e-12)


def test_measured_equal_times_give_even_split():
    for p in range(1, 9):
        for layers in range(p, 30):
            times = StageTimes((0.01,) * p, (0.003,) * p)
            assert split_from_times(layers, times) == colossalai_even_split(layers, p)


def test_fixed_block_part_moves_split_toward_even():
    """12 blocks, stage 0 at half speed. Pure compute (block 1 s / 2 s): 4 + 8 blocks, both
    8 s. With 2 s of each block fixed (4 s / 3 s a block): 5 + 7 (20 s, 21 s) beats
    4 + 8 (16 s, 24 s) and 6 + 6 (24 s, 18 s)."""
    speeds = [0.5, 1.0]
    compute_only = StageTimes(affine_block_seconds(0.0, 1.0, speeds), (0.0, 0.0))
    assert split_from_times(12, compute_only) == [4, 8]
    with_fixed = StageTimes(affine_block_seconds(2.0, 1.0, speeds), (0.0, 0.0))
    assert with_fixed.block_s == (4.0, 3.0)
    assert split_from_times(12, with_fixed) == [5, 7]
    # Mostly fixed work: the split approaches the even one.
    assert split_from_times(12, StageTimes(affine_block_seconds(50.0, 1.0, speeds), (0, 0))) == [
        6,
        6,
    ]


def test_measured_times_respect_memory_and_reject_bad_input():
    times = StageTimes((0.01, 0.02), (0.0, 0.0))
    assert split_from_times(12, times) == [8, 4]
    assert split_from_times(12, times, memory_bytes=[7.0, 100.0], layer_bytes=1.0) == [7, 5]
    with pytest.raises(ValueError, match="block seconds"):
        StageTimes((0.0, 0.01), (0.0, 0.0))
    with pytest.raises(ValueError, match="one block and one fixed"):
        StageTimes((0.01,), (0.0, 0.0))
    with pytest.raises(ValueError, match="fixed seconds"):
        StageTimes((0.01,), (-1.0,))


def test_slack_takes_the_most_even_split_within_it_against_brute_force():
    """Oracle: among every split whose slowest stage is within (1 + slack) of the best (brute
    force), the fewest blocks moved from Colossal-AI's even split (half the L1 distance); the
    result must be one of them at that distance."""
    rng = random.Random(17)
    for _ in range(200):
        p = rng.randint(2, 5)
        layers = rng.randint(p, 13)
        times = StageTimes(
            tuple(rng.choice([0.011, 0.0145, 0.02, 0.007]) for _ in range(p)),
            tuple(rng.choice([0.0, 0.002, 0.009]) for _ in range(p)),
        )
        slack = rng.choice([0.0, 0.01, 0.05, 0.2])
        splits = list(compositions(layers, p, [layers] * p))
        best = min(max(times.stage_seconds(c)) for c in splits)
        limit = best * (1 + slack) * (1 + 1e-12)
        even = colossalai_even_split(layers, p)

        def moved(c, even=even):
            return sum(abs(a - b) for a, b in zip(c, even, strict=True))

        allowed = [c for c in splits if max(times.stage_seconds(c)) <= limit]
        got = split_from_times(layers, times, slack=slack)
        assert sum(got) == layers and max(times.stage_seconds(got)) <= limit
        if slack > 0:
            assert moved(got) == min(moved(c) for c in allowed)


def test_slack_breaks_a_near_tie_toward_even():
    """Measured PP=2 x TP=2 stage times (bench run 3): [4, 8] predicts 72.5 ms, [5, 7] 72.9 ms
    (0.6% apart); with 2% slack the split that moves fewer blocks wins."""
    times = StageTimes((0.01375, 0.00803), (0.00412, 0.00821))
    assert split_from_times(12, times) == [4, 8]
    assert split_from_times(12, times, slack=0.02) == [5, 7]
    assert split_from_times(12, times, slack=0.5) == [6, 6]  # 86.6 ms is within 1.5 x 72.5


@pytest.mark.parametrize("seed", range(12))
def test_near_best_splits_match_brute_force(seed):
    rng = random.Random(seed)
    p = rng.randint(1, 4)
    layers = rng.randint(p, 10)
    times = StageTimes(
        tuple(rng.uniform(0.5, 2.0) for _ in range(p)), tuple(rng.uniform(0, 2) for _ in range(p))
    )
    slack, limit = rng.choice([0.0, 0.03, 0.2]), rng.randint(1, 6)
    every = [list(s) for s in itertools.product(range(1, layers + 1), repeat=p) if sum(s) == layers]
    worst = {tuple(s): max(times.stage_seconds(s)) for s in every}
    best = min(worst.values())
    within = [s for s in every if worst[tuple(s)] <= best * (1 + slack) * (1 + 1e-12)]
    got = near_best_splits(layers, times, slack=slack, limit=limit)
    assert len(got) == min(limit, len(within))
    assert all(s in within for s in got)
    assert worst[tuple(got[0])] == pytest.approx(best)
    # Fastest predicted first; the ones left out are no faster than the last one kept.
    kept = [worst[tuple(s)] for s in got]
    assert kept == sorted(kept)
    assert all(worst[tuple(s)] >= kept[-1] for s in within if s not in got)


def test_near_best_splits_of_a_measured_near_tie():
    # PP=2 x TP=2 (c) as measured: [5, 7] predicted 2.2% ahead of [4, 8], [6, 6] far behind.
    times = StageTimes((0.01685, 0.01056), (0.00834, 0.01023))
    assert near_best_splits(12, times, slack=0.05, limit=3) == [[5, 7], [4, 8]]
    assert near_best_splits(12, times, slack=0.01, limit=3) == [[5, 7]]
    with pytest.raises(ValueError, match="slack"):
        near_best_splits(12, times, slack=-0.1, limit=3)
