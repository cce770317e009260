"""The pipeline part of a plan (planner/stage_plan.py) and its resolution for configs.

Oracles: Colossal-AI's own even split for equal devices, brute force over every stage split
for small models on random unequal devices (speed and memory), and hand-counted block costs.
"""

from __future__ import annotations

import random

import pytest
from transformers import GPT2Config

from colossal_hetero.config import ClusterConfig, HeteroConfig, ParallelConfig, PlanConfig
from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.schema import DeviceSpec
from colossal_hetero.planner.hf import model_spec_from_hf
from colossal_hetero.planner.resolve import stage_plan_for, unplanned_notice, wants_stage_plan
from colossal_hetero.planner.spec import REFERENCE_FLOPS, ClusterSpec
from colossal_hetero.planner.stage_plan import (
    block_costs,
    even_split,
    format_stage_plan,
    plan_stages,
)
from tests.unit.test_planner_stages import colossalai_even_split, compositions


def _spec(n_layer: int, batch: int = 8, seq: int = 16, vocab: int = 1000):
    config = GPT2Config(n_layer=n_layer, n_embd=64, n_head=4, vocab_size=vocab, n_positions=seq)
    return model_spec_from_hf(config, batch, seq)


def test_block_costs_by_hand():
    costs = block_costs(_spec(3))
    h, s = 64, 16
    assert costs.num_blocks == 3
    # Per token: qkv 2*h*3h, attention scores and values 2*2*s*h, out 2*h*h, MLP 2*2*h*4h,
    # and the spec's 8h for each of the two layer norms.
    per_token = 6 * h * h + 4 * s * h + 2 * h * h + 16 * h * h + 2 * 8 * h
    assert costs.block_flops == pytest.approx(s * per_token)
    assert costs.tail_flops > costs.block_flops  # the LM head over the vocabulary
    assert costs.message_bytes == s * h * 4  # one sample's hidden states, fp32


def test_equal_devices_give_colossalai_even_split():
    for p in (2, 3, 4):
        for n_layer in range(p, 9):
            spec = _spec(n_layer)
            cluster = ClusterSpec.from_relative([1.0] * p)
            plan = plan_stages(spec, cluster, p, 1, 8, balance_ends=False)
            want = colossalai_even_split(n_layer, p)
            assert list(plan.layers_per_stage) == want == even_split(n_layer, p)


def _max_stage_time(layers, flops, costs):
    times = [n * costs.block_flops / f for n, f in zip(layers, flops, strict=True)]
    times[0] += costs.head_flops / flops[0]
    times[-1] += costs.tail_flops / flops[-1]
    return max(times)


def test_split_matches_brute_force_on_random_unequal_devices():
    rng = random.Random(7)
    for _ in range(30):
        p, n_layer = rng.choice([(2, 5), (3, 6), (4, 7)])
        spec = _spec(n_layer, vocab=rng.choice([100, 4000]))
        costs = block_costs(spec)
        speeds = [rng.choice([0.25, 0.5, 1.0]) for _ in range(p)]
        # Memory for the states of 2..n blocks per stage, plus the ends and some activations.
        room = [rng.randint(2, n_layer) * costs.block_state_bytes for _ in range(p)]
        room[0] += costs.head_state_bytes
        room[-1] += costs.tail_state_bytes
        memory = [r + 64 * costs.block_activation_bytes for r in room]
        cluster = ClusterSpec.from_relative(speeds, memory_gib=[m / 2**30 for m in memory])
        plan = plan_stages(spec, cluster, p, 1, 8)
        # The planner's memory rule: the states of at most this many blocks beside the ends.
        ends = [costs.head_state_bytes] + [0.0] * (p - 2) + [costs.tail_state_bytes]
        caps = [int((m - e) // costs.block_state_bytes) for m, e in zip(memory, ends, strict=True)]
        flops = list(plan.stage_flops)
        best = min(_max_stage_time(c, flops, costs) for c in compositions(n_layer, p, caps))
        assert sum(plan.layers_per_stage) == n_layer
        assert all(n <= c for n, c in zip(plan.layers_per_stage, caps, strict=True))
        assert _max_stage_time(plan.layers_per_stage, flops, costs) == pytest.approx(best)


def test_slow_stage_gets_fewer_layers_and_a_faster_predicted_step():
    spec = _spec(12, batch=16)
    cluster = ClusterSpec.from_relative([1.0, 1.0, 0.5, 1.0])
    plan = plan_stages(spec, cluster, 4, 1, 16, balance_ends=False)
    assert plan.layers_per_stage == (4, 3, 2, 3) or plan.layers_per_stage[2] == 2
    assert plan.even_layers == (3, 3, 3, 3)
    assert plan.step_s < plan.even_step_s
    assert 1 <= plan.k <= plan.num_microbatches and 16 % plan.num_microbatches == 0
    text = format_stage_plan(plan)
    assert "layers per stage" in text and "kFkB group size k" in text


def test_fixed_layer_overhead_moves_split_toward_even_as_brute_force():
    """Blocks cost FLOPs at the stage's rate plus a fixed per-layer overhead (measured on the
    fastest device, the same on every device). Oracle: brute force over the affine stage times
    built here by hand; the hand case mirrors the measured PP=2 one (half of a full-speed
    block fixed): 12 blocks on speeds [0.5, 1] go [4, 8] without overhead, [5, 7] with it."""
    spec = _spec(12, batch=16)
    costs = block_costs(spec)
    layers_in_block = sum(1 for la in spec.layers if ".0." in la.name)
    micro = 4  # 16 samples in 4 micro-batches
    compute = micro * 3 * costs.block_flops / REFERENCE_FLOPS  # one block, fwd + 2x bwd, speed 1

    def planned(overhead_s: float) -> tuple[int, ...]:
        cluster = ClusterSpec.from_relative([0.5, 1.0], layer_overhead_s=overhead_s)
        return plan_stages(spec, cluster, 2, 1, 16, balance_ends=False, num_microbatches=4)

    assert planned(0.0).layers_per_stage == (4, 8)
    assert planned(compute / layers_in_block).layers_per_stage == (5, 7)
    rng = random.Random(3)
    for _ in range(10):
        per_layer = rng.uniform(0.0, 3.0) * compute / layers_in_block
        block = [compute / v + layers_in_block * per_layer for v in (0.5, 1.0)]

        def slowest(split, block=block):
            return max(n * b for n, b in zip(split, block, strict=True))

        best = min(slowest(c) for c in compositions(12, 2, [12, 12]))
        assert slowest(planned(per_layer).layers_per_stage) == pytest.approx(best, rel=1e-9)


def test_resolution_uses_the_calibrated_layer_overhead():
    """The plugin's path (``stage_plan_for``): ``plan.layer_overhead_us`` (what the probe
    measures at configure) reaches the split. Same numbers as the hand case above: at 1 TFLOP/s
    and half a full-speed block fixed, [4, 8] becomes [5, 7]."""
    spec = _spec(12, batch=16)
    costs = block_costs(spec)
    layers_in_block = sum(1 for la in spec.layers if ".0." in la.name)
    compute = 4 * 3 * costs.block_flops / 1e12  # 4-sample micro-batches, speed 1 at 1 TFLOP/s

    def split(overhead_us: float) -> tuple[int, ...]:
        config = HeteroConfig(
            parallel=ParallelConfig(pp=2, num_microbatches=4),
            cluster=ClusterConfig(devices=[DeviceSpec(speed=0.5), DeviceSpec(speed=1.0)]),
            plan=PlanConfig(mode="auto", reference_tflops=1.0, layer_overhead_us=overhead_us),
        )
        return stage_plan_for(config, spec, 2).layers_per_stage

    assert split(0.0) == (4, 8)
    assert split(compute / layers_in_block * 1e6) == (5, 7)


def test_resolution_for_configs():
    devices = [DeviceSpec(speed=1.0), DeviceSpec(speed=0.5)]
    config = HeteroConfig(
        parallel=ParallelConfig(pp=2, num_microbatches=4),
        cluster=ClusterConfig(devices=devices),
        plan=PlanConfig(mode="auto"),
    )
    assert wants_stage_plan(config)
    assert "pipeline stages are planned" in (unplanned_notice(config) or "")
    plan = stage_plan_for(config, _spec(6), 2)
    assert plan.layers_per_stage[0] > plan.layers_per_stage[1]
    # Equal devices, mode even, an explicit split: the stages stay as configured.
    equal = HeteroConfig(parallel=config.parallel, plan=config.plan)
    even = HeteroConfig(
        parallel=config.parallel, cluster=config.cluster, plan=PlanConfig(mode="even")
    )
    explicit = HeteroConfig(
        parallel=ParallelConfig(pp=2, num_microbatches=4, num_layers_per_stage=[3, 3]),
        cluster=config.cluster,
        plan=config.plan,
    )
    assert not any(wants_stage_plan(c) for c in (equal, even, explicit))
    # Not enough memory for the blocks: one ConfigError naming plan.
    tiny = [DeviceSpec(speed=1.0, memory_gib=1e-6), DeviceSpec(speed=0.5, memory_gib=1e-6)]
    small = HeteroConfig(parallel=config.parallel, cluster=ClusterConfig(devices=tiny))
    with pytest.raises(ConfigError, match="^plan: infeasible pipeline stages"):
        stage_plan_for(small, _spec(6), 2)


def test_plan_command_shows_the_stages(tmp_path, capsys):
    from colossal_hetero.cli import main

    path = tmp_path / "pp.yaml"
    path.write_text(
        "model: {arch: gpt2, hf: {n_layer: 6, n_embd: 64, n_head: 4, n_positions: 32}}\n"
        "parallel: {pp: 2, num_microbatches: 4}\n"
        "cluster: {device: cpu, devices: [{speed: 1.0}, {speed: 0.5}]}\n"
        "plan: {mode: auto}\n"
        "data: {dataset: pydoc_topics, seq_len: 32, global_batch_size: 8}\n"
    )
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "layers per stage" in out and "micro-batches" in out and "kFkB group size k" in out


def test_planned_microbatches_and_k_for_configs():
    """``num_microbatches: 0`` / ``pp_k: 0`` are planned, other values kept as configured."""
    devices = [DeviceSpec(speed=1.0), DeviceSpec(speed=0.5)]
    cluster = ClusterConfig(devices=devices)

    def plan_for(**parallel):
        config = HeteroConfig(parallel=ParallelConfig(pp=2, **parallel), cluster=cluster)
        return stage_plan_for(config, _spec(6, batch=16), 2)

    both = plan_for(num_microbatches=0, pp_schedule="kfkb", pp_k=0)
    assert 16 % both.num_microbatches == 0 and 2 <= both.num_microbatches <= 16
    assert 1 <= both.k <= both.num_microbatches and both.configured == ()
    # The planned pair is the simulated optimum over every divisor and k (brute force).
    costs = block_costs(_spec(6, batch=16))
    assert costs.num_blocks == 6
    for m in (2, 4, 8, 16):
        fixed = plan_for(num_microbatches=m, pp_schedule="kfkb", pp_k=0)
        assert fixed.num_microbatches == m and fixed.configured == ("microbatches",)
        assert both.step_s <= fixed.step_s * (1 + 1e-9)
    kept = plan_for(num_microbatches=4, pp_schedule="kfkb", pp_k=3)
    assert (kept.num_microbatches, kept.k) == (4, 3)
    assert kept.configured == ("microbatches", "k")
    # A fixed k bounds the count from below; 1f1b plans m for k = 1.
    assert plan_for(num_microbatches=0, pp_schedule="kfkb", pp_k=8).num_microbatches >= 8
    assert plan_for(num_microbatches=0).k == 1
    # With an explicit split only m and k are planned; the split stays.
    split = plan_for(num_microbatches=0, num_layers_per_stage=[2, 4])
    assert split.layers_per_stage == (2, 4) and "layers" in split.configured
    assert "(configured)" in format_stage_plan(split)
    # Bad values: one error naming the field (the loader prefixes the section).
    with pytest.raises(ValueError, match="^num_microbatches: must be >= 1, or 0"):
        ParallelConfig(pp=2, num_microbatches=-1)
    with pytest.raises(ValueError, match="^pp_k: must be >= 1, or 0"):
        ParallelConfig(pp=2, pp_k=-2)
    with pytest.raises(ValueError, match="^num_microbatches: 0 .planned. needs batch_split"):
        ParallelConfig(pp=2, num_microbatches=0, batch_split="speed")
