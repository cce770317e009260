"""Config loading and validation: strict keys, typed values, layout checks, YAML round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from colossal_hetero.config import (
    ConfigError,
    RunConfig,
    dump_config,
    from_dict,
    load_config,
)
from colossal_hetero.preflight import validate_run

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def _run(**sections) -> RunConfig:
    return from_dict(RunConfig, sections)


def test_unknown_key_names_its_path_and_suggests():
    with pytest.raises(
        ConfigError, match=r"^parallel\.tp_size: unknown key \(did you mean 'tp'\?\)"
    ):
        _run(parallel={"tp_size": 2})


def test_unknown_top_level_section():
    with pytest.raises(ConfigError, match=r"^paralel: unknown key"):
        _run(paralel={"tp": 2})


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"parallel": {"tp": "two"}}, r"^parallel\.tp: expected int, got str 'two'"),
        ({"parallel": {"tp": True}}, r"^parallel\.tp: expected int, got bool"),
        ({"parallel": {"precision": "fp8"}}, r"^parallel\.precision: must be one of"),
        ({"parallel": {"tp": 0}}, r"^parallel\.tp: must be >= 1, got 0"),
        ({"parallel": {"zero_stage": 1}}, r"^parallel\.zero_stage: ZeRO stage 1 needs"),
        (
            {"cluster": {"devices": [{"speed": 1.0}, {"speed": 0}]}},
            r"^cluster\.devices\[1\]\.speed: must be > 0, got 0",
        ),
        ({"emulation": {"compute": [{"rank": 0}]}}, r"^emulation\.compute\[0\]: .*factor"),
        (
            {"emulation": {"compute": [{"rank": 0, "factor": 0.5}]}},
            r"^emulation\.compute\[0\]\.factor: must be >= 1",
        ),
        ({"data": []}, r"^data: expected a mapping"),
        ({"gc": {"every": -1}}, r"^gc\.every: must be >= 0, got -1"),
        ({"gc": {"evry": 2}}, r"^gc\.evry: unknown key \(did you mean 'every'\?\)"),
    ],
)
def test_bad_values_name_the_field(sections, message):
    with pytest.raises(ConfigError, match=message):
        _run(**sections)


def test_int_is_accepted_for_float():
    config = _run(optimizer={"lr": 1})
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)


@pytest.mark.parametrize(
    ("sections", "world_size", "message"),
    [
        ({"parallel": {"tp": 2, "pp": 2}}, 6, r"^parallel: tp \* pp = 2 \* 2 = 4 does not divide"),
        (
            {"parallel": {"tp": 2, "dp": 3}},
            4,
            r"^parallel: tp \* pp \* dp = 2 \* 1 \* 3 = 6 != world",
        ),
        (
            {"parallel": {"tp": 3}, "model": {"hf": {"n_head": 4}}},
            3,
            r"^parallel\.tp: 3 does not divide the 4 attention heads",
        ),
        (
            {"parallel": {"pp": 4}, "model": {"hf": {"n_layer": 2}}},
            4,
            r"^parallel\.pp: 4 stages but the model has only 2 layers",
        ),
        ({"model": {"hf": {"n_layr": 2}}}, 1, r"^model\.hf\.n_layr: not a field of"),
        ({"cluster": {"devices": [{}, {}]}}, 4, r"^cluster\.devices: lists 2 devices"),
        (
            {"emulation": {"compute": [{"rank": 5, "factor": 2}]}},
            4,
            r"^emulation\.compute\[0\]\.rank: rank 5 does not exist",
        ),
        (
            {"data": {"global_batch_size": 6}, "parallel": {"dp": 4}},
            4,
            r"^data\.global_batch_size: 6 is not divisible",
        ),
        (
            {"data": {"global_batch_size": 8}, "parallel": {"pp": 2, "num_microbatches": 3}},
            2,
            r"^parallel\.num_microbatches: 3 does not divide",
        ),
        ({"model": {"arch": "vit"}}, 1, r"^data\.dataset: 'pydoc_topics' does not fit"),
        ({"data": {"seq_len": 2048}}, 1, r"^data\.seq_len: 2048 exceeds"),
        (
            {
                "model": {"arch": "vit"},
                "data": {"dataset": "digits", "global_batch_size": 64},
                "train": {"eval_batches": 4},
            },
            1,
            r"^train\.eval_batches: 4 batches of 64 exceed",
        ),
    ],
)
def test_impossible_layouts_are_rejected(sections, world_size, message):
    with pytest.raises(ConfigError, match=message):
        validate_run(_run(**sections), world_size)


def test_valid_layout_returns_dp():
    config = _run(parallel={"tp": 2, "pp": 2}, model={"hf": {"n_head": 4, "n_layer": 4}})
    assert validate_run(config, 8) == 2


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_validate_and_round_trip(path, tmp_path):
    config = load_config(path)
    world_size = len(config.cluster.devices) or config.parallel.tp * config.parallel.pp * max(
        config.parallel.dp, 1
    )
    validate_run(config, world_size)
    copy = tmp_path / "copy.yaml"
    copy.write_text(dump_config(config))
    assert load_config(copy) == config


def test_top_level_must_be_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)


def _write(tmp_path, text: str, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_repeated_key_inside_a_list_names_its_index(tmp_path):
    path = _write(
        tmp_path, "cluster:\n  devices:\n    - {speed: 1.0}\n    - {speed: 1, speed: 2}\n"
    )
    with pytest.raises(ConfigError, match=r"^cluster\.devices\[1\]\.speed: key given twice"):
        load_config(path)


def test_the_same_key_in_two_mappings_is_fine(tmp_path):
    path = _write(tmp_path, "parallel: {tp: 2}\ncluster:\n  devices: [{speed: 1}, {speed: 1}]\n")
    assert load_config(path).parallel.tp == 2


def test_model_hf_values_are_type_checked_against_transformers_defaults():
    from colossal_hetero.preflight import checked_hf_config

    def model(**hf):
        return from_dict(RunConfig, {"model": {"arch": "llama", "hf": hf}}).model

    # int for float, null for an optional size, and a bool where a bool belongs are accepted.
    hf = checked_hf_config(model(rms_norm_eps=1, head_dim=None, tie_word_embeddings=True))
    assert hf.rms_norm_eps == 1 and hf.tie_word_embeddings is True
    for bad, message in [
        ({"num_hidden_layers": 2.0}, r"^model\.hf\.num_hidden_layers: expected int, got float"),
        ({"num_hidden_layers": True}, r"^model\.hf\.num_hidden_layers: expected int, got bool"),
        ({"head_dim": "16"}, r"^model\.hf\.head_dim: expected int, got str '16'"),
        ({"tie_word_embeddings": 1}, r"^model\.hf\.tie_word_embeddings: expected bool"),
    ]:
        with pytest.raises(ConfigError, match=message):
            checked_hf_config(model(**bad))


def test_explicit_llama_head_dim_lifts_the_hidden_divisibility_rule():
    sections = {
        "model": {
            "arch": "llama",
            "hf": {
                "hidden_size": 36,
                "num_attention_heads": 8,
                "head_dim": 8,
                "num_hidden_layers": 1,
                "intermediate_size": 64,
            },
        }
    }
    assert validate_run(_run(**sections), 1) == 1
    sections["model"]["hf"].pop("head_dim")
    with pytest.raises(ConfigError, match=r"^model\.hf\.num_attention_heads: 8 attention heads"):
        validate_run(_run(**sections), 1)


def test_even_memory_check_threshold_and_lower_bound():
    """The check refuses exactly below the estimate it reports, and that estimate is at least
    each rank's half of the weights, gradients and Adam moments (16 bytes per fp32 param)."""
    import re

    import torch

    from colossal_hetero.models import build_model

    hf = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 32}

    def run(memory_gib: float) -> RunConfig:
        return _run(
            model={"arch": "gpt2", "hf": hf},
            data={"seq_len": 32, "global_batch_size": 8},
            parallel={"tp": 2},
            cluster={"devices": [{"memory_gib": memory_gib}] * 2},
        )

    with pytest.raises(ConfigError, match=r"^cluster\.devices\[0\]\.memory_gib") as info:
        validate_run(run(1e-6), 2)
    need = float(re.search(r"needs about ([0-9.e+-]+) GiB", str(info.value)).group(1))
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(run(1.0).model).parameters())
    assert need >= params * 16 / 2 / 2**30 * 0.99  # 3 significant digits in the message
    validate_run(run(need * 1.01), 2)
    with pytest.raises(ConfigError, match=r"memory_gib"):
        validate_run(run(need * 0.98), 2)
