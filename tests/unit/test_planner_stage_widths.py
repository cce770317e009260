"""Tensor-parallel widths planned inside each pipeline stage (planner/stage_widths.py).

Oracles: the layers each stage holds counted from the split (blocks, embeddings on the first
stage, the head on the last), the slowest replica per TP rank read off the rank layout, and
HAP's own search run directly on the stage's devices and layers (equal devices: even widths).
"""

from __future__ import annotations

import dataclasses

import pytest
from transformers import GPT2Config

from colossal_hetero.config import ClusterConfig, HeteroConfig, ParallelConfig, PlanConfig
from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.schema import DeviceSpec
from colossal_hetero.planner.hf import model_spec_from_hf
from colossal_hetero.planner.loop import search_plan
from colossal_hetero.planner.resolve import stage_widths_for, wants_stage_widths
from colossal_hetero.planner.spec import ClusterSpec
from colossal_hetero.planner.stage_widths import plan_stage_widths, stage_cluster, stage_spec


def _spec(n_layer: int = 4, batch: int = 8):
    config = GPT2Config(n_layer=n_layer, n_embd=64, n_head=4, vocab_size=1000, n_positions=32)
    return model_spec_from_hf(config, batch, 32)


def test_stage_spec_holds_its_blocks_and_ends():
    spec = _spec(4)
    first, last = stage_spec(spec, [1, 3], 0, 2), stage_spec(spec, [1, 3], 1, 2)
    names0, names1 = [la.name for la in first.layers], [la.name for la in last.layers]
    assert names0[0] == "transformer.wte" and all(".h.0." in n for n in names0[2:])
    assert {n.split(".")[2] for n in names1 if ".h." in n} == {"1", "2", "3"}
    assert "lm_head" in names1[-2] or any("lm_head" in n for n in names1)
    assert not any(la.tied for la in last.layers)  # the last stage owns its head's copy
    assert len(names0) + len(names1) == len(spec.layers)
    assert first.batch_size == last.batch_size == 4  # one pipeline's half of the batch
    with pytest.raises(ValueError, match="num_layers_per_stage"):
        stage_spec(spec, [2, 3], 0, 1)


def test_stage_cluster_takes_the_slowest_replica_per_tp_rank():
    # pp=2, tp=2, dp=2: rank (d * 2 + s) * 2 + t.
    speeds = [1.0, 0.5, 1.0, 1.0, 0.25, 1.0, 1.0, 1.0]
    cluster = ClusterSpec.from_relative(speeds)
    stage0 = stage_cluster(cluster, 2, 2, 0)
    assert stage0.speeds == (cluster.speeds[4], cluster.speeds[1])  # 0.25 (d=1), 0.5 (d=0)
    assert stage_cluster(cluster, 2, 2, 1).speeds == (cluster.speeds[2],) * 2


def test_each_stage_plans_its_own_widths():
    spec = _spec(4)
    cluster = ClusterSpec.from_relative([1.0, 0.5, 1.0, 1.0])
    plans = plan_stage_widths(spec, cluster, 2, 2, [2, 2], space="megatron")
    assert plans[0].widths["heads"][0] > plans[0].widths["heads"][1]  # the faster TP rank
    assert plans[0].widths["ffn"][0] > plans[0].widths["ffn"][1]
    assert len(set(plans[1].widths["heads"])) == 1 and len(set(plans[1].widths["ffn"])) == 1
    direct = search_plan(
        stage_cluster(cluster, 2, 2, 0), stage_spec(spec, [2, 2], 0, 1), tp_size=2, space="megatron"
    )
    # Each is HAP's own plan of that stage's layers on that stage's devices, except that the
    # tied vocabulary is sharded alike everywhere, as the last stage planned it.
    assert {k: v for k, v in direct.widths.items() if k != "vocab"} == {
        k: v for k, v in plans[0].widths.items() if k != "vocab"
    }
    assert plans[0].widths["vocab"] == plans[1].widths["vocab"] == (500, 500)


def test_resolution_for_configs():
    devices = [DeviceSpec(speed=1.0), DeviceSpec(speed=0.5), DeviceSpec(speed=1.0)] + [
        DeviceSpec(speed=1.0)
    ]
    parallel = ParallelConfig(tp=2, pp=2, num_microbatches=4)
    config = HeteroConfig(parallel=parallel, cluster=ClusterConfig(devices=devices))
    assert wants_stage_widths(config)
    plans = stage_widths_for(config, _spec(4), 4, [2, 2])
    assert plans[0].widths["heads"] == (3, 1)
    equal = HeteroConfig(parallel=parallel)
    even = HeteroConfig(parallel=parallel, cluster=config.cluster, plan=PlanConfig(mode="even"))
    no_tp = HeteroConfig(parallel=ParallelConfig(pp=4, num_microbatches=4), cluster=config.cluster)
    assert not any(wants_stage_widths(c) for c in (equal, even, no_tp))
    tiny = [DeviceSpec(speed=s, memory_gib=1e-6) for s in (1.0, 0.5, 1.0, 1.0)]
    small = HeteroConfig(parallel=parallel, cluster=ClusterConfig(devices=tiny))
    with pytest.raises(ConfigError, match="^plan: infeasible tensor-parallel widths"):
        stage_widths_for(small, _spec(4), 4, [2, 2])


def test_plan_command_shows_each_stages_widths(tmp_path, capsys):
    from colossal_hetero.cli import main

    path = tmp_path / "pp2tp2.yaml"
    path.write_text(
        "model: {arch: gpt2, hf: {n_layer: 4, n_embd: 64, n_head: 4, n_positions: 32}}\n"
        "parallel: {tp: 2, pp: 2, num_microbatches: 4}\n"
        "cluster: {device: cpu, devices: [{speed: 1.0}, {speed: 0.5}, {speed: 1.0}, "
        "{speed: 1.0}]}\n"
        "plan: {mode: auto}\n"
        "data: {dataset: pydoc_topics, seq_len: 32, global_batch_size: 8}\n"
    )
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "stage 0 TP widths" in out and "stage 1 TP widths" in out
    assert "'heads': (3, 1)" in out.split("stage 0 TP widths")[1].split("\n")[0]


def test_each_micro_batch_pays_the_fixed_per_layer_cost():
    """A stage's step runs every layer once per micro-batch, so the fixed per-layer cost
    (framework and launch work, paid at each device's own speed) counts ``m`` times against
    FLOPs that stay the pipeline's batch. Reference: the search on a cluster whose per-layer
    cost is written ``m`` times over, with one pass. Without a fixed cost the count changes
    nothing; with one, the half-speed device's MLP share shrinks as ``m`` grows."""
    spec = _spec(4, batch=16)
    speeds = [0.5, 1.0, 1.0, 1.0]
    flops = 7e10  # FLOP/s of speed 1.0; each layer's fixed cost in FLOP at that rate below
    bare = ClusterSpec.from_relative(speeds, reference_flops=flops)
    fixed = ClusterSpec.from_relative(speeds, reference_flops=flops, layer_overhead_s=2e-5)
    assert fixed.layer_overhead_flops == pytest.approx(2e-5 * flops)

    def ffn(cluster: ClusterSpec, m: int) -> tuple[int, ...]:
        return plan_stage_widths(spec, cluster, 2, 2, [2, 2], m, space="megatron")[0].widths["ffn"]

    assert ffn(bare, 1) == ffn(bare, 8)
    for m in (2, 8):
        written = dataclasses.replace(fixed, layer_overhead_flops=m * fixed.layer_overhead_flops)
        assert plan_stage_widths(spec, fixed, 2, 2, [2, 2], m, space="megatron") == (
            plan_stage_widths(spec, written, 2, 2, [2, 2], 1, space="megatron")
        )
    shares = [ffn(fixed, m)[0] for m in (1, 2, 8)]
    assert shares[0] > shares[-1] and shares == sorted(shares, reverse=True)
    with pytest.raises(ValueError, match="num_microbatches"):
        plan_stage_widths(spec, fixed, 2, 2, [2, 2], 0)


def test_config_resolution_uses_the_configured_micro_batch_count():
    """``stage_widths_for`` plans a step of ``parallel.num_microbatches`` passes unless told
    the count that runs (a planned one): told 8, a config of 2 plans as a config of 8."""
    devices = [DeviceSpec(speed=s) for s in (0.5, 1.0, 1.0, 1.0)]
    plan = PlanConfig(mode="auto", reference_tflops=0.07, layer_overhead_us=20.0)

    def config(m: int) -> HeteroConfig:
        parallel = ParallelConfig(tp=2, pp=2, num_microbatches=m)
        return HeteroConfig(parallel=parallel, cluster=ClusterConfig(devices=devices), plan=plan)

    spec = _spec(4, batch=16)
    eight = stage_widths_for(config(8), spec, 4, [2, 2])
    assert stage_widths_for(config(2), spec, 4, [2, 2], num_microbatches=8) == eight
    two = stage_widths_for(config(2), spec, 4, [2, 2])
    assert two[0].widths["ffn"][0] > eight[0].widths["ffn"][0]
