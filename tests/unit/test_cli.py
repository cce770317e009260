"""The `colossal-hetero` command: check, plan, and plan files that train consumes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from colossal_hetero.cli import main
from colossal_hetero.config import load_config
from colossal_hetero.config.schema import DeviceSpec
from colossal_hetero.planner import load_plan
from colossal_hetero.planner.resolve import (
    compare_layouts,
    plan_run,
    resolve_plan,
    unplanned_notice,
)
from tests.tolerances import FLOAT64_FORMULA_RTOL

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_check_reports_the_layout(capsys):
    assert main(["check", str(CONFIGS / "demo.yaml")]) == 0
    assert "ok: gpt2, world size 2 = tp 2 x pp 1 x dp 1" in capsys.readouterr().out


def test_unknown_key_is_one_line_and_status_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("parallel: {tp_size: 2}\n")  # Colossal-AI's spelling
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "colossal-hetero: config error: parallel.tp_size: unknown key (did you mean 'tp'?)"
    )


def test_plan_writes_a_file_that_training_resolves_identically(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert main(["plan", str(CONFIGS / "planned_gpt2_tp2.yaml"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "widths per tp rank" in printed and "speedup" in printed
    plan = load_plan(out)
    # The slow rank (speed 0.5) gets fewer heads; widths are whole heads summing to 6.
    assert sum(plan.widths["heads"]) == 6 and plan.widths["heads"][0] > plan.widths["heads"][1]

    config = yaml.safe_load((CONFIGS / "planned_gpt2_tp2.yaml").read_text())
    config["plan"] = {"mode": "file", "path": str(out)}
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(config))
    assert resolve_plan(load_config(run_file), 2) == plan
    auto = resolve_plan(load_config(CONFIGS / "planned_gpt2_tp2.yaml"), 2)
    assert auto == plan  # deterministic: planning again gives the same plan


def test_plan_file_for_another_layout_is_rejected(tmp_path):
    out = tmp_path / "plan.yaml"
    assert main(["plan", str(CONFIGS / "planned_gpt2_tp2.yaml"), "--out", str(out)]) == 0
    config = yaml.safe_load((CONFIGS / "planned_gpt2_tp2.yaml").read_text())
    config["plan"] = {"mode": "file", "path": str(out)}
    config["data"]["global_batch_size"] = 8
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=r"^plan\.path: the plan is for a global batch of 4"):
        resolve_plan(load_config(run_file), 2)


def test_plan_file_the_runtime_cannot_execute_is_rejected(tmp_path):
    """A plan searched in another space (full: per-layer strategies beyond the stock pairing,
    or SFB for a TP layout) is refused, not silently run as something else."""
    config_path = CONFIGS / "planned_gpt2_tp2.yaml"
    out = tmp_path / "plan.yaml"
    assert main(["plan", str(config_path), "--out", str(out)]) == 0
    for space in ("full", "megatron_sfb"):
        plan = yaml.safe_load(out.read_text())
        plan["space"] = space
        edited = tmp_path / f"{space}.yaml"
        edited.write_text(yaml.safe_dump(plan))
        config = yaml.safe_load(config_path.read_text())
        config["plan"] = {"mode": "file", "path": str(edited)}
        run_file = tmp_path / f"run_{space}.yaml"
        run_file.write_text(yaml.safe_dump(config))
        with pytest.raises(ValueError, match=rf"^plan\.path: .* space {space}, .* runs megatron\)"):
            resolve_plan(load_config(run_file), 2)


def test_homogeneous_cluster_trains_even(tmp_path):
    assert resolve_plan(load_config(CONFIGS / "gpt2_tp2_pp2.yaml"), 4) is None


def test_auto_plan_with_pipeline_says_it_stays_even():
    config = load_config(CONFIGS / "gpt2_tp2_pp2.yaml")
    assert unplanned_notice(config.plugin_config()) is None  # homogeneous: nothing to plan
    hetero = dataclasses.replace(
        config,
        cluster=dataclasses.replace(
            config.cluster, devices=[DeviceSpec(speed=s) for s in (1.0, 1.0, 0.5, 0.5)]
        ),
    )
    assert resolve_plan(hetero, 4) is None
    notice = unplanned_notice(hetero.plugin_config())
    assert notice is not None and "parallel.pp = 2" in notice


def test_plan_compares_the_other_layouts_of_the_same_ranks(capsys):
    config_path = CONFIGS / "planned_gpt2_tp4.yaml"
    assert main(["plan", str(config_path)]) == 0
    out = capsys.readouterr().out
    assert "tp 4 x dp 1" in out and "<- this config" in out
    config = load_config(config_path)
    options = {o.tp: o for o in compare_layouts(config, 4)}
    assert sorted(options) == [1, 2, 4]
    # The config's own layout is predicted as `plan` predicts it on its own.
    assert options[4].step_time == pytest.approx(
        plan_run(config, 4).step_time, rel=FLOAT64_FORMULA_RTOL
    )  # one float64 cost model evaluated twice
    assert all(o.step_time is not None and o.dp == 4 // o.tp for o in options.values())

    # A layout the run's checks reject is listed with the reason: 2 heads cannot go to 4 ranks.
    two_heads = dataclasses.replace(
        config, model=dataclasses.replace(config.model, hf={**config.model.hf, "n_head": 2})
    )
    options = {o.tp: o for o in compare_layouts(two_heads, 4)}
    assert options[4].step_time is None and "heads" in options[4].reason
    assert options[1].step_time is not None and options[2].step_time is not None


def test_bench_names_dispatch_and_refusals():
    """Every name the CLI offers is one the dispatcher knows; an unknown name and a
    --only that selects nothing are one ValueError each, before any rank starts."""
    from colossal_hetero.bench import BENCHMARKS, run_benchmark
    from colossal_hetero.cli import build_parser

    parser = build_parser()
    for name in BENCHMARKS:
        assert parser.parse_args(["bench", name]).name == name
    with pytest.raises(ValueError, match=r"unknown benchmark 'nope'; known: static, network"):
        run_benchmark("nope", quick=True)
    with pytest.raises(ValueError, match=r"--only 'no-such-case' matches no case of static"):
        run_benchmark("static", quick=True, only="no-such-case")
