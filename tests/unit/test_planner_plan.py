"""search_plan end to end: sanity cases, batch shares, round trips, errors and planning time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from colossal_hetero.planner import (
    ClusterSpec,
    Plan,
    dump_plan,
    format_plan,
    load_plan,
    model_spec_from_hf,
    search_plan,
)
from tests.tolerances import FLOAT64_FORMULA_RTOL, LP_ATOL


def _gpt2(layers=2, hidden=128, heads=4, vocab=512, positions=256):
    return types.SimpleNamespace(
        model_type="gpt2",
        n_embd=hidden,
        n_head=heads,
        n_layer=layers,
        n_inner=None,
        vocab_size=vocab,
        n_positions=positions,
        tie_word_embeddings=True,
    )


def _model(batch=8, seq=64, **kw):
    return model_spec_from_hf(_gpt2(**kw), batch_size=batch, seq_len=seq, dtype_bytes=2)


def _compute_only(speeds, **kw) -> ClusterSpec:
    """Links so fast and latency-free that communication is free."""
    kw.setdefault("memory_gib", 64.0)
    return ClusterSpec.from_relative(
        speeds, reference_flops=1e12, bandwidth_gbps=1e9, latency_s=0.0, **kw
    )


def test_compute_only_widths_follow_speed_and_equal_devices_split_evenly():
    model = _model(hidden=256, heads=8)
    plan = search_plan(_compute_only([1.0, 1.0, 0.5, 0.5]), model, space="megatron")
    np.testing.assert_allclose(plan.tp_ratios, [1 / 3, 1 / 3, 1 / 6, 1 / 6], atol=LP_ATOL)  # LP
    assert plan.layer("transformer.h.0.attn.c_attn").widths == (96, 96, 32, 32)  # whole heads
    assert plan.layer("transformer.h.0.mlp.c_fc").widths == (341, 341, 171, 171)
    assert plan.widths == {  # what colossal_hetero.policies.widths consumes
        "vocab": (171, 171, 85, 85),
        "heads": (3, 3, 1, 1),
        "ffn": (341, 341, 171, 171),
    }
    assert plan.speedup > 1.3
    even = search_plan(_compute_only([1.0] * 4), model, space="megatron")
    assert even.layer("transformer.h.0.mlp.c_fc").widths == (256,) * 4
    assert even.speedup == pytest.approx(1.0, rel=FLOAT64_FORMULA_RTOL)


def test_data_parallel_batch_shares_follow_speed():
    plan = search_plan(_compute_only([1.0, 1.0, 0.5, 0.5]), _model(batch=60), tp_size=1)
    assert plan.group_samples == (20, 20, 10, 10)
    assert [plan.device_samples(d) for d in range(4)] == [20, 20, 10, 10]
    assert all(la.strategy == "replicate" and la.widths is None for la in plan.layers)


def test_hybrid_plan_is_consistent_and_deterministic():
    cluster = ClusterSpec.from_relative(
        [1.0, 0.5, 1.0, 1.0, 0.25, 0.25], bandwidth_gbps=50, memory_gib=8
    )
    model = _model(batch=24, vocab=1000)
    plan = search_plan(cluster, model, tp_size=2, alignment=8)
    assert plan == search_plan(cluster, model, tp_size=2, alignment=8)
    assert (plan.tp_size, plan.dp_size, sum(plan.group_samples)) == (2, 3, 24)
    assert all(sum(row) == n for row, n in zip(plan.batch_split, plan.group_samples, strict=True))
    for layer in plan.layers:
        if layer.widths is not None:
            assert len(layer.widths) == 2
            if "attn" in layer.name and layer.split == "in":
                assert all(w % 32 == 0 for w in layer.widths)  # whole heads of 32
    assert plan.step_time <= plan.even_step_time
    assert max(plan.device_times) <= plan.step_time * (1 + 1e-9)  # float64 max of sums: ~1e-15
    assert plan.speedup == pytest.approx(
        plan.even_step_time / plan.step_time, rel=FLOAT64_FORMULA_RTOL
    )


def test_plan_round_trips_through_yaml_and_json(tmp_path):
    cluster = ClusterSpec.from_relative([1.0, 1.0, 0.5, 0.25])
    plan = search_plan(cluster, _model(), alignment=8)
    assert Plan.from_dict(plan.to_dict()) == plan
    for suffix in (".yaml", ".json"):
        path = tmp_path / f"plan{suffix}"
        dump_plan(plan, path)
        assert load_plan(path) == plan
    with pytest.raises(ValueError, match="unknown keys"):
        Plan.from_dict({**plan.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match=r"\.json, \.yaml or \.yml"):
        dump_plan(plan, tmp_path / "plan.txt")


def test_format_plan_lists_layers_and_devices():
    cluster = ClusterSpec.from_relative([1.0, 1.0, 0.5, 0.25])
    text = format_plan(search_plan(cluster, _model(layers=3), space="megatron"))
    assert "transformer.h.0-2.attn.c_attn" in text  # identical blocks merged
    assert "speedup" in text and "widths per tp rank" in text
    assert len([line for line in text.splitlines() if line.strip().startswith("3 ")]) == 1


def test_zero_speed_device_is_named():
    with pytest.raises(ValueError, match=r"device 2: speed must be a finite number > 0, got 0"):
        ClusterSpec.from_relative([1.0, 1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"device 1: speed"):
        ClusterSpec(speeds=(1e12, -1.0), memory_bytes=(1e9, 1e9), bandwidths=(1e9, 1e9))


def test_more_tp_ranks_than_heads_names_the_layer():
    with pytest.raises(ValueError, match=r"layer transformer\.h\.0\.attn\.c_attn: tp_size 8 "):
        search_plan(ClusterSpec.from_relative([1.0] * 8), _model(heads=4))


def test_tp_size_must_divide_devices():
    with pytest.raises(ValueError, match="tp_size 3 must be >= 1 and divide"):
        search_plan(ClusterSpec.from_relative([1.0] * 4), _model(), tp_size=3)


def test_device_without_memory_for_its_minimum_shard_is_named():
    # Position embeddings and norms are never split: 256 x 128 + ... params at 16 bytes each.
    memory = [8.0, 0.0001, 8.0, 8.0]
    with pytest.raises(ValueError, match=r"^device 1: needs at least \d.* bytes .* but has"):
        search_plan(ClusterSpec.from_relative([1.0] * 4, memory_gib=memory), _model())


def test_model_too_big_for_all_devices_names_a_device():
    model = _model(batch=64, seq=256, hidden=512, heads=8, vocab=8000)
    cluster = ClusterSpec.from_relative([1.0, 0.5], memory_gib=0.05)
    with pytest.raises(ValueError, match=r"^device \d: needs .* no split of the model fits"):
        search_plan(cluster, model)


def test_planning_48_layer_gpt_on_64_heterogeneous_devices_is_fast():
    gpt_xl = _gpt2(layers=48, hidden=1600, heads=25, vocab=50257, positions=1024)
    model = model_spec_from_hf(gpt_xl, batch_size=256, seq_len=1024, dtype_bytes=2)
    speeds = np.random.default_rng(0).choice([1.0, 0.6, 0.35], size=64)
    cluster = ClusterSpec.from_relative(list(speeds), memory_gib=80, bandwidth_gbps=100)
    # CPU time of this process, not wall time: other processes loading the machine cannot
    # inflate it (planning is pure computation, about 1 s of it).
    start = time.process_time()
    plan = search_plan(cluster, model, tp_size=8, alignment=8)
    elapsed = time.process_time() - start
    assert elapsed <= 10.0, f"planning took {elapsed:.1f} s of CPU"
    assert len(plan.layers) == len(model.layers) and plan.num_devices == 64


def test_plans_are_identical_across_processes():
    """Every rank plans alone: hash seeds (set and dict orders) must not change the plan."""
    code = (
        "import json, types; from colossal_hetero.planner import *\n"
        "cfg = types.SimpleNamespace(model_type='llama', hidden_size=128, num_attention_heads=8,"
        " num_key_value_heads=4, head_dim=None, num_hidden_layers=3, intermediate_size=344,"
        " vocab_size=1000, attention_bias=False, mlp_bias=False, tie_word_embeddings=True)\n"
        "model = model_spec_from_hf(cfg, batch_size=24, seq_len=64)\n"
        "cluster = ClusterSpec.from_relative([1, .3, .7, 1, .5, .5, 1, .2], bandwidth_gbps=40)\n"
        "print(json.dumps(search_plan(cluster, model, tp_size=4, alignment=8).to_dict()))\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1 and next(iter(outputs)).startswith("{")


def test_cluster_from_config_converts_units():
    from colossal_hetero.config.schema import ClusterConfig, DeviceSpec

    devices = [DeviceSpec(speed=0.5, memory_gib=8, bandwidth_gbps=80), DeviceSpec()]
    cluster = ClusterSpec.from_config(ClusterConfig(devices=devices), 2, reference_flops=1e12)
    assert cluster.speeds == (0.5e12, 1e12)
    assert cluster.memory_bytes == (8 * 2**30, 16 * 2**30)  # DeviceSpec's default: 16 GiB
    assert cluster.bandwidths == (1e10, 1.25e10)  # Gbit/s -> bytes/s
    assert ClusterSpec.from_config(ClusterConfig(), 3).num_devices == 3
    with pytest.raises(ValueError, match="lists 2 devices but the world size is 4"):
        ClusterSpec.from_config(ClusterConfig(devices=devices), 4)


def test_a_plan_file_with_bad_yaml_is_one_line_naming_plan_path(tmp_path):
    """The plugin's own plan loading (plan_for_model -> _load) refuses broken YAML in one line
    naming plan.path and the place, not a multi-line YAMLError."""
    from colossal_hetero.config.loader import ConfigError
    from colossal_hetero.planner.resolve import _load

    bad = tmp_path / "plan.yaml"
    bad.write_text("widths: {heads: [4, 2]\nrank: 0\n")
    with pytest.raises(ConfigError) as info:
        _load(bad)
    message = str(info.value)
    assert message.startswith("plan.path: ") and "invalid YAML at line" in message
    assert "\n" not in message


def test_very_slow_device_gets_no_heads_and_equal_devices_the_even_split(tmp_path):
    """A rank 50x slower than the others: its proportional share of 8 heads is 0.05 head,
    which rounds to 0 for GPT-2 (its policy runs a rank with no heads) and to the one-group
    floor for BERT (whose stock attention needs a head). Equal devices still split evenly."""
    model = _model(hidden=256, heads=8)
    plan = search_plan(_compute_only([1.0, 1.0, 0.02, 1.0]), model, space="megatron")
    assert plan.widths["heads"][2] == 0 and sum(plan.widths["heads"]) == 8
    qkv = plan.layer("transformer.h.0.attn.c_attn").widths
    out = plan.layer("transformer.h.0.attn.c_proj").widths
    assert qkv is not None and out is not None and qkv[2] == out[2] == 0
    assert f"out: [{qkv[0]}, {qkv[1]}, 0, {qkv[3]}]" in format_plan(plan)  # the printout
    dump_plan(plan, tmp_path / "plan.yaml")
    assert load_plan(tmp_path / "plan.yaml").widths == plan.widths  # and the plan file
    even = search_plan(_compute_only([1.0] * 4), model, space="megatron")
    assert even.widths["heads"] == (2, 2, 2, 2)
    bert = types.SimpleNamespace(
        model_type="bert",
        hidden_size=256,
        num_attention_heads=8,
        num_hidden_layers=2,
        intermediate_size=1024,
        vocab_size=512,
        max_position_embeddings=128,
        type_vocab_size=2,
    )
    bert_model = model_spec_from_hf(bert, batch_size=8, seq_len=64, dtype_bytes=2)
    bert_plan = search_plan(_compute_only([1.0, 1.0, 0.02, 1.0]), bert_model, space="megatron")
    assert bert_plan.widths["heads"][2] == 1


def test_all_zero_speeds_or_shares_name_the_field():
    with pytest.raises(ValueError, match="device 2: speed"):
        ClusterSpec.from_relative([1.0, 1.0, 0.0, 1.0])
    from colossal_hetero.planner import round_widths

    with pytest.raises(ValueError, match="ratios must not all be zero"):
        round_widths(8, [0.0, 0.0], granularity=2)
