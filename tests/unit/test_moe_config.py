"""Expert-parallel config: the shipped YAML validates; each bad input is one ConfigError naming
its field (parallel.ep, model.hf.num_experts_per_tok, moe.chunk_kib, moe.placement)."""

from __future__ import annotations

from pathlib import Path

import pytest

from colossal_hetero.config.loader import ConfigError, from_dict, load_config
from colossal_hetero.config.schema import RunConfig
from colossal_hetero.preflight import validate_run

ROOT = Path(__file__).resolve().parents[2]
HF = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
}


def _run(parallel: dict, moe: dict | None = None, hf: dict | None = None, **extra) -> RunConfig:  # type: ignore[no-untyped-def]
    """A tiny Mixtral run config; ``extra`` adds top-level sections (``cluster=...``)."""
    data = {
        "model": {"arch": "mixtral", "hf": {**HF, **(hf or {})}},
        "data": {"seq_len": 16, "global_batch_size": 8},
        "parallel": parallel,
        "moe": moe or {},
        "train": {"eval_every": 0},
        **extra,
    }
    return from_dict(RunConfig, data)


def test_shipped_config_validates_as_ep2_dp2() -> None:
    config = load_config(ROOT / "configs" / "mixtral_ep2_dp2.yaml")
    assert validate_run(config, 4) == 4
    assert config.parallel.ep == 2 and config.model.hf["num_local_experts"] == 4
    assert config.plugin_config().moe == config.moe


def test_devices_listed_for_their_speeds_validate() -> None:
    """An expert-parallel run lists cluster.devices for re-placement's speeds; the planner's
    dense memory model (which has no experts) must not reject it."""
    devices = [{"speed": 1.0}, {"speed": 1.0}, {"speed": 0.5}, {"speed": 0.5}]
    config = _run({"ep": 2}, {"replace_every": 5}, cluster={"devices": devices})
    assert validate_run(config, 4) == 4


def test_clipping_runs_on_our_reducers() -> None:
    """parallel.max_norm with ep > 1 at zero_stage 0 is accepted (moe/clip.py's global norm;
    checked against a single process in tests/distributed/test_moe_accumulate.py)."""
    assert validate_run(_run({"ep": 2, "max_norm": 1.0, "zero_stage": 0}), 4) == 4


@pytest.mark.parametrize(
    ("parallel", "moe", "hf", "world", "fragment"),
    [
        ({"ep": 3}, None, {"num_local_experts": 6}, 4, "parallel.ep=3 does not divide the world"),
        ({"ep": 4}, None, {"num_local_experts": 6}, 4, "parallel.ep=4 does not divide the number"),
        ({"ep": 2, "pp": 2}, None, None, 4, "parallel.pp: expert parallelism runs with pp = 1"),
        ({"ep": 2}, None, {"num_experts_per_tok": 5}, 4, "model.hf.num_experts_per_tok: top-5"),
        ({"ep": 2}, {"placement": [[0, 1], [2]]}, None, 4, "moe.placement: expert 3 is placed"),
        ({"ep": 2}, {"placement": [[0, 1], [2, 3, 0]]}, None, 4, "expert 0 is placed twice"),
        ({"ep": 2}, {"placement": [[0, 1, 2, 3]]}, None, 4, "moe.placement: lists 1"),
        ({}, {"placement": [[0, 1], [2, 3]]}, None, 4, "moe.placement: needs expert"),
    ],
)
def test_bad_moe_layout_is_one_config_error(parallel, moe, hf, world, fragment) -> None:
    with pytest.raises(ConfigError) as error:
        validate_run(_run(parallel, moe, hf), world)
    assert fragment in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("moe", "fragment"),
    [
        ({"chunk_kib": 0}, "moe.chunk_kib: must be >= 1, got 0"),
        ({"max_inflight": 0}, "moe.max"),
        ({"pipeline_chunks": 0}, "moe.pipeline_chunks: must be >= 1, got 0"),
        ({"pipeline_chunks": 2, "packing": True}, "moe.pipeline_chunks: pipelining is not"),
        ({"chunk_efficiency": 0.5}, "moe.chunk_efficiency: unknown key"),  # session 10's knob
        ({"chunk_auto": "yes"}, "moe.chunk_auto: expected bool"),
    ],
)
def test_bad_moe_field_names_it(moe, fragment) -> None:
    with pytest.raises(ValueError) as error:
        _run({"ep": 2}, moe)
    assert fragment in str(error.value)


def test_ep_needs_an_expert_model() -> None:
    data = {"model": {"arch": "llama"}, "parallel": {"ep": 2}, "train": {"eval_every": 0}}
    with pytest.raises(ConfigError, match="parallel.ep: 2 needs a mixture-of-experts model"):
        validate_run(from_dict(RunConfig, data), 4)


def _checkpointed_run(parallel: dict) -> RunConfig:
    return from_dict(
        RunConfig,
        {
            "model": {"arch": "mixtral", "hf": HF},
            "data": {"seq_len": 16, "global_batch_size": 8},
            "parallel": {"ep": 2, **parallel},
            "train": {"eval_every": 0},
            "checkpoint": {"dir": "ckpt"},
        },
    )


@pytest.mark.parametrize("parallel", [{}, {"zero_stage": 1, "precision": "bf16"}])
def test_ep_run_checkpoints(parallel: dict) -> None:
    """checkpoint.dir with ep > 1 is accepted on both optimizer paths (our reducers at
    zero_stage 0, Colossal-AI's ZeRO MoE optimizer): checkpoint/moe.py saves either, checked
    in tests/distributed/test_moe_checkpoint.py."""
    assert validate_run(_checkpointed_run(parallel), 4) == 4


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_replacement_runs_at_every_zero_stage(precision: str, zero: int) -> None:
    """moe.replace_every moves whole experts at zero_stage 0 (any precision;
    tests/distributed/test_moe_replace.py) and ZeRO's fp32 master slices at 1 and 2
    (Colossal-AI's MoE plugin runs 2 as 1; tests/distributed/test_moe_replace_zero.py): both
    ranks' paths accept it, preflight's validate_run and the plugin's check_moe_model."""
    from transformers import MixtralConfig

    from colossal_hetero.moe.checks import check_moe_model

    config = _run({"ep": 2, "precision": precision, "zero_stage": zero}, {"replace_every": 2})
    assert validate_run(config, 4) == 4
    placement = check_moe_model(config.parallel, config.moe, MixtralConfig(**HF), 4)
    assert placement is not None and placement.num_devices == 2
