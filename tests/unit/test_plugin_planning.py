"""The plugin's planning at configure, without a process group: calibration arithmetic, the
workload read from a dataloader, the plan recording a user policy's widths, the short table."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from colossal_hetero.config import (
    ClusterConfig,
    DataConfig,
    DeviceSpec,
    ModelConfig,
    ParallelConfig,
    PlanConfig,
    RunConfig,
)
from colossal_hetero.planner.plan import format_plan_summary, load_plan, with_widths
from colossal_hetero.planner.resolve import (
    calibrated,
    needs_calibration,
    plan_run,
    resolve_plan,
)
from colossal_hetero.plugin.planning import announce, plan_that_runs, workload_of
from colossal_hetero.policies import ResizableGPT2LMHeadPolicy
from colossal_hetero.utils.probe import WorldProbe

GPT2 = ModelConfig(arch="gpt2", hf={"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64})


def _run(speeds, tflops=None, tp=2) -> RunConfig:
    devices = [DeviceSpec(speed=s, bandwidth_gbps=50.0) for s in speeds]
    return RunConfig(
        model=GPT2,
        data=DataConfig(seq_len=32, global_batch_size=4 * (len(speeds) // tp)),
        parallel=ParallelConfig(tp=tp),
        cluster=ClusterConfig(device="cpu", devices=devices),
        plan=PlanConfig(reference_tflops=tflops),
    )


def test_calibration_sets_the_device_model_from_the_probe():
    config = _run([0.5, 0.25]).plugin_config()
    assert needs_calibration(config)
    probe = WorldProbe(flops=4e10, layer_overhead_s=3e-5, gbps=20.0, latency_s=2e-5)
    out = calibrated(config, probe)
    # The fastest rank measured 40 GFLOP/s and is declared at speed 0.5: speed 1.0 is 80.
    assert out.plan.reference_tflops == pytest.approx(0.08)
    assert out.plan.layer_overhead_us == pytest.approx(30.0)
    assert out.plan.latency_us == pytest.approx(20.0)
    assert [d.bandwidth_gbps for d in out.cluster.devices] == [20.0, 20.0]  # capped by the link
    assert [d.speed for d in out.cluster.devices] == [0.5, 0.25]
    assert not needs_calibration(out)
    assert not needs_calibration(_run([1, 0.5], tflops=0.01).plugin_config())


def test_uncalibrated_auto_runs_plan_at_configure_and_plan_cli_uses_the_default():
    run = _run([1.0, 0.5])
    assert resolve_plan(run, 2) is None  # the plugin measures and plans at configure
    plan = plan_run(run, 2)  # `colossal-hetero plan`: the GPU-class default rate
    assert plan.device_flops == (100e12, 50e12)
    assert resolve_plan(_run([1.0, 0.5], tflops=0.01), 2) is not None


def test_workload_from_a_dataloader_without_drawing_a_batch():
    ids = torch.zeros(10, 48, dtype=torch.long)
    loader = DataLoader(TensorDataset(ids), batch_size=3, shuffle=True)
    state = torch.random.get_rng_state()
    assert workload_of(loader, dp_size=2) == (6, 48)
    assert torch.equal(state, torch.random.get_rng_state())  # the shuffle order is untouched

    class Dicts(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"input_ids": torch.zeros(20, dtype=torch.long)}

    assert workload_of(DataLoader(Dicts(), batch_size=2), dp_size=1) == (2, 20)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(20)

    assert workload_of(DataLoader(Stream(), batch_size=2), dp_size=1) is None  # not indexable
    assert workload_of(DataLoader(Stream(), batch_size=None), dp_size=1) is None


def _plan():
    return plan_run(_run([1.0, 0.5], tflops=0.005), 2)


def test_with_widths_records_widths_in_the_plan_and_its_layers():
    plan = _plan()
    assert plan.widths["heads"] != (2, 2)
    new = with_widths(plan, {"heads": (2, 2), "ffn": (128, 128)})
    assert new.widths["heads"] == (2, 2) and new.widths["ffn"] == (128, 128)
    assert new.widths["vocab"] == plan.widths["vocab"]
    for old, layer in zip(plan.layers, new.layers, strict=True):
        if layer.kind in ("attention_qkv", "attention_out") and layer.widths:
            assert layer.widths == (32, 32)  # 2 heads of 16 features each
        if layer.kind == "mlp_up" and layer.widths:
            assert layer.widths == (128, 128)
        if layer.kind in ("embedding", "lm_head"):
            assert layer.widths == old.widths


def test_plan_that_runs_follows_the_user_policy():
    plan = _plan()
    resizable = ResizableGPT2LMHeadPolicy()
    resizable.widths = {"heads": (2, 2), "ffn": (128, 128), "vocab": plan.widths["vocab"]}
    recorded, note = plan_that_runs(plan, resizable, tp_size=2)
    assert recorded is not None and recorded.widths["heads"] == (2, 2)
    assert "overrides" in note
    resizable.widths = dict(plan.widths)
    assert plan_that_runs(plan, resizable, tp_size=2) == (plan, "")

    class Stock:  # any shardformer policy that is not resizable shards evenly
        pass

    recorded, note = plan_that_runs(plan, Stock(), tp_size=2)
    assert recorded is None and "not resizable" in note
    assert plan_that_runs(plan, None, tp_size=2) == (plan, "")


def test_summary_table_fits_80_columns():
    plan = dataclasses.replace(_plan(), model="gpt2")
    text = format_plan_summary(plan)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert lines[1].split() == ["rank", "TFLOP/s", "heads", "ffn", "vocab", "samples", "busy", "ms"]
    assert len(lines) == 2 + plan.num_devices + 1
    assert f"{plan.speedup:.2f}x" in lines[-1]
    # A 4-rank, large-vocabulary plan still fits.
    big = with_widths(plan, {"vocab": (25129, 25128)})
    assert max(len(line) for line in format_plan_summary(big).splitlines()) <= 80


def test_announce_prints_on_rank_zero_and_writes_the_run_folder(tmp_path, capsys):
    plan = _plan()
    announce(plan, "", 1, tmp_path / "r1")
    assert capsys.readouterr().out == "" and not (tmp_path / "r1").exists()
    announce(plan, "a note", 0, tmp_path / "run")
    out = capsys.readouterr().out
    assert out.startswith("colossal-hetero: a note\n") and format_plan_summary(plan) in out
    assert load_plan(tmp_path / "run" / "plan.yaml") == plan


def test_uncalibrated_infeasible_layout_is_refused_before_any_collective():
    run = _run([1.0, 0.5])
    tiny = [dataclasses.replace(d, memory_gib=1e-4) for d in run.cluster.devices]
    run = dataclasses.replace(run, cluster=dataclasses.replace(run.cluster, devices=tiny))
    with pytest.raises(ValueError, match="plan: infeasible: device 0"):
        resolve_plan(run, 2)


def test_pipeline_planning_measures_the_device_model_first(monkeypatch):
    """pp > 1: the stage plan and each stage's TP widths use the probed device model when
    ``plan.reference_tflops`` is unset (one probe), as the tensor-parallel planner does; the
    reference: the same config with the probe's figures written in (no probe then)."""
    from types import SimpleNamespace

    from colossal_hetero.config import HeteroConfig
    from colossal_hetero.models import build_model
    from colossal_hetero.plugin import planning

    probe = WorldProbe(flops=7e10, layer_overhead_s=1.4e-3, gbps=1e3, latency_s=1e-5)
    calls: list[object] = []
    monkeypatch.setattr(planning, "probe_world", lambda device: calls.append(device) or probe)
    model = build_model(GPT2)

    def configure(plan: PlanConfig, m: int = 2, scheduler: object = None) -> tuple[object, dict]:
        devices = [DeviceSpec(speed=s, bandwidth_gbps=1e3) for s in (0.5, 1.0, 1.0, 1.0)]
        config = HeteroConfig(
            parallel=ParallelConfig(tp=2, pp=2, num_microbatches=m),
            cluster=ClusterConfig(device="cpu", devices=devices),
            plan=plan,
        )
        stage_manager = SimpleNamespace(stage=0, num_layers_per_stage=None)
        plugin = SimpleNamespace(
            config=config,
            engine=SimpleNamespace(scheduler=scheduler),
            world_size=4,
            workload=(8, 32),
            stage_manager=stage_manager,
            rank=1,  # not 0: prints nothing
            device=torch.device("cpu"),
        )
        return planning.plan_pipeline_at_configure(plugin, model)

    stage_plan, widths = configure(PlanConfig(mode="auto"))
    assert calls == [torch.device("cpu")]  # measured once
    # The fastest declared speed is 1.0: speed 1.0 is the measured 0.07 TFLOP/s.
    written = PlanConfig(mode="auto", reference_tflops=0.07, layer_overhead_us=1400.0)
    want_plan, want_widths = configure(dataclasses.replace(written, latency_us=10.0))
    assert calls == [torch.device("cpu")]  # a configured device model is not probed
    assert widths == want_widths and stage_plan.layers_per_stage == want_plan.layers_per_stage
    # The overhead is paid at each device's own speed: the half-speed device of stage 0 gets
    # less than its 1/3 share of the MLP, as it does not without it (the GPU-class default).
    ffn = widths["ffn"]
    assert ffn[0] < sum(ffn) / 3
    _, default_widths = configure(PlanConfig(mode="auto", reference_tflops=100.0))
    assert default_widths["ffn"][0] >= sum(ffn) // 3
    # Every micro-batch pays the fixed cost: with the count planned (0 in the config) the
    # widths follow the count the scheduler is given, as for a config of that many.
    small = dataclasses.replace(written, layer_overhead_us=20.0)
    scheduler = SimpleNamespace(num_microbatches=None)
    _, planned = configure(small, m=0, scheduler=scheduler)
    count = scheduler.num_microbatches
    assert count > 1
    assert planned == configure(small, m=count)[1] != configure(small, m=1)[1]
