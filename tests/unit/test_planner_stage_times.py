"""Measured stage times in the plugin's stage plan (``plan.stage_times``).

Oracles: brute force over every stage split (the slowest stage's ``fixed + n * block``, within
the memory caps) and hand-computed splits; the config errors name the field.
"""

from __future__ import annotations

import random

import pytest
from transformers import GPT2Config

from colossal_hetero.config import ClusterConfig, HeteroConfig, ParallelConfig, PlanConfig
from colossal_hetero.config.loader import ConfigError, load_config
from colossal_hetero.config.schema import DeviceSpec, StageTimeSpec
from colossal_hetero.planner.hf import model_spec_from_hf
from colossal_hetero.planner.resolve import stage_plan_for, wants_stage_plan
from colossal_hetero.planner.spec import ClusterSpec
from colossal_hetero.planner.stage_plan import block_costs, format_stage_plan, plan_stages
from colossal_hetero.planner.stages import StageTimes
from tests.unit.test_planner_stages import compositions


def _spec(n_layer: int, batch: int = 8, seq: int = 16):
    config = GPT2Config(n_layer=n_layer, n_embd=64, n_head=4, vocab_size=1000, n_positions=seq)
    return model_spec_from_hf(config, batch, seq)


def _slowest(split, times: StageTimes) -> float:
    return max(f + n * b for n, b, f in zip(split, times.block_s, times.fixed_s, strict=True))


def test_hand_computed_splits():
    spec, cluster = _spec(12), ClusterSpec.from_relative([1.0, 1.0])
    # Stage 1's block takes twice stage 0's: 8 * 10 ms = 4 * 20 ms.
    times = StageTimes((0.01, 0.02), (0.0, 0.0))
    assert plan_stages(spec, cluster, 2, 1, 8, stage_times=times).layers_per_stage == (8, 4)
    # Plus 20 ms fixed on stage 1: [9, 3] has 90 vs 80 ms, [8, 4] 80 vs 100 ms.
    times = StageTimes((0.01, 0.02), (0.0, 0.02))
    plan = plan_stages(spec, cluster, 2, 1, 8, stage_times=times)
    assert plan.layers_per_stage == (9, 3)
    assert plan.measured_stage_s == pytest.approx((0.09, 0.14))  # even [6, 6]: 20 + 120 ms
    assert "plan.stage_times: slowest stage 90 ms" in format_stage_plan(plan)
    # Without times the equal cluster's model split is used and nothing measured is shown.
    plain = plan_stages(spec, cluster, 2, 1, 8)
    assert plain.measured_stage_s == () and "stage_times" not in format_stage_plan(plain)


def test_split_matches_brute_force_with_memory_caps():
    rng = random.Random(11)
    for _ in range(40):
        p, n_layer = rng.choice([(2, 6), (3, 7), (4, 8)])
        spec = _spec(n_layer)
        costs = block_costs(spec)
        blocks = [rng.randint(2, n_layer) for _ in range(p)]
        memory = [b * costs.block_state_bytes + 64 * costs.block_activation_bytes for b in blocks]
        memory[0] += costs.head_state_bytes
        memory[-1] += costs.tail_state_bytes
        cluster = ClusterSpec.from_relative([1.0] * p, memory_gib=[m / 2**30 for m in memory])
        times = StageTimes(
            tuple(rng.choice([0.004, 0.006, 0.01, 0.013]) for _ in range(p)),
            tuple(rng.choice([0.0, 0.003, 0.02]) for _ in range(p)),
        )
        ends = [costs.head_state_bytes] + [0.0] * (p - 2) + [costs.tail_state_bytes]
        caps = [int((m - e) // costs.block_state_bytes) for m, e in zip(memory, ends, strict=True)]
        feasible = list(compositions(n_layer, p, caps))
        if not feasible:
            with pytest.raises(ValueError):
                plan_stages(spec, cluster, p, 1, 8, stage_times=times)
            continue
        plan = plan_stages(spec, cluster, p, 1, 8, stage_times=times)
        best = min(_slowest(c, times) for c in feasible)
        assert tuple(plan.layers_per_stage) in feasible
        assert _slowest(plan.layers_per_stage, times) == pytest.approx(best, rel=1e-12)


def _config(times, pp=2, mode="auto", **parallel) -> HeteroConfig:
    return HeteroConfig(
        parallel=ParallelConfig(pp=pp, num_microbatches=4, **parallel),
        plan=PlanConfig(mode=mode, stage_times=times),
    )


def test_config_resolution_uses_the_measured_times():
    times = [StageTimeSpec(block_s=0.01), StageTimeSpec(block_s=0.02, fixed_s=0.02)]
    config = _config(times)  # equal devices: measured times alone make the split planned
    assert wants_stage_plan(config)
    plan = stage_plan_for(config, _spec(12), 2)
    assert plan.layers_per_stage == (9, 3) and "layers" not in plan.configured
    assert not wants_stage_plan(_config([]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"times": [StageTimeSpec(block_s=0.01)]}, "1 entries for parallel.pp = 2"),
        ({"times": [StageTimeSpec(block_s=0.01)], "pp": 1}, "needs parallel.pp > 1"),
        ({"mode": "even"}, "needs plan.mode auto"),
        ({"num_layers_per_stage": [3, 3]}, "num_layers_per_stage fixes the split"),
    ],
)
def test_config_errors_name_the_field(kwargs, message):
    kwargs.setdefault("times", [StageTimeSpec(block_s=0.01), StageTimeSpec(block_s=0.02)])
    with pytest.raises(ValueError, match=f"^plan.stage_times: .*{message}"):
        _config(**kwargs)


def test_non_positive_values_and_yaml_paths(tmp_path):
    with pytest.raises(ValueError, match="^block_s: must be > 0"):
        StageTimeSpec(block_s=0.0)
    with pytest.raises(ValueError, match="^fixed_s: must be >= 0"):
        StageTimeSpec(block_s=0.01, fixed_s=-0.001)
    base = "parallel: {pp: 2, num_microbatches: 4}\n"
    cases = {
        "plan: {stage_times: [{block_s: 0.01}, {block_s: -1}]}": "plan.stage_times[1].block_s",
        "plan: {stage_times: [{block_s: 0.01}]}": "plan.stage_times: 1 entries",
        "plan: {stage_times: [{block_s: 0.01, fixd_s: 0}, {block_s: 1}]}": "fixd_s: unknown",
    }
    for text, where in cases.items():
        path = tmp_path / "c.yaml"
        path.write_text(base + text + "\n")
        with pytest.raises(ConfigError, match=where.replace("[", r"\[").replace("]", r"\]")):
            load_config(path)
    path.write_text(base + "plan: {stage_times: [{block_s: 0.01}, {block_s: 0.02}]}\n")
    run = load_config(path)
    assert [t.block_s for t in run.plan.stage_times] == [0.01, 0.02]
    assert run.plan.stage_times[0].fixed_s == 0.0


def test_measured_times_on_a_heterogeneous_cluster_override_the_model():
    # The model says stage 1 is half speed ([8, 4]-like); the measurement says stage 0 is.
    devices = [DeviceSpec(speed=1.0), DeviceSpec(speed=0.5)]
    times = [StageTimeSpec(block_s=0.02), StageTimeSpec(block_s=0.01)]
    config = HeteroConfig(
        parallel=ParallelConfig(pp=2, num_microbatches=4),
        cluster=ClusterConfig(devices=devices),
        plan=PlanConfig(mode="auto", stage_times=times),
    )
    assert stage_plan_for(config, _spec(12), 2).layers_per_stage == (4, 8)
