"""parallel.tp_mode 2d in the config checks: one ConfigError naming the field, before launch.

The same checks run in the plugin's constructor and configure on every rank (the distributed
test tests/distributed/test_tp2d_plugin.py checks them there).
"""

from __future__ import annotations

import pytest

from colossal_hetero.config import ConfigError, RunConfig, from_dict
from colossal_hetero.preflight import validate_run

GPT2 = {"arch": "gpt2", "hf": {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64}}
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _run(parallel=None, model=None, batch: int = 8) -> RunConfig:
    model = model or {"arch": "gpt2", "hf": {**GPT2["hf"], **NO_DROPOUT}}
    sections = {
        "model": model,
        "data": {"global_batch_size": batch, "seq_len": 32},
        "parallel": {"tp": 4, "tp_mode": "2d", **(parallel or {})},
        "train": {"eval_every": 0},
    }
    return from_dict(RunConfig, sections)


@pytest.mark.parametrize(
    ("config", "world_size", "message"),
    [
        (_run({"tp": 2}), 4, r"^parallel\.tp: 2D tensor parallelism needs a square size, got 2"),
        (_run({"tp": 8}), 8, r"^parallel\.tp: 2D tensor parallelism needs a square size, got 8"),
        (_run({"max_norm": 1.0}), 4, r"^parallel\.max_norm: 1.0 is not supported"),
        (_run({"pp": 2}), 8, r"^parallel\.pp: 2 is not supported"),
        (_run(model={"arch": "bert"}), 4, r"^model\.arch: .* supports \['gpt2', 'llama', 'vit'\]"),
        (_run(model=GPT2), 4, r"^model\.\['attn_pdrop', 'embd_pdrop', 'resid_pdrop'\]"),
        (
            _run(model={"arch": "gpt2", "hf": {**GPT2["hf"], **NO_DROPOUT, "n_head": 1}}),
            4,
            r"^model\.hf\.n_head: 1 heads do not split evenly over the 2 mesh columns",
        ),
        (
            _run(
                model={
                    "arch": "llama",
                    "hf": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1},
                }
            ),
            4,
            r"^model\.hf\.num_key_value_heads: 1 key/value heads",
        ),
        (_run(batch=6), 8, r"^data\.global_batch_size: 3 samples per data-parallel group"),
    ],
)
def test_2d_layouts_that_cannot_run_are_refused(config, world_size, message):
    with pytest.raises(ConfigError, match=message):
        validate_run(config, world_size)


def test_2d_layouts_that_fit_pass():
    assert validate_run(_run(), 4) == 1
    assert validate_run(_run(batch=8), 8) == 2  # dp 2 around a 2 x 2 mesh
    llama = {"arch": "llama", "hf": {"hidden_size": 64, "num_attention_heads": 4}}
    assert validate_run(_run(model=llama), 4) == 1


def test_tp_mode_auto_is_resolved_by_the_launch_and_refused_unresolved():
    """The launch path replaces auto by the planner's pick (the one plan prints); the plugin,
    which lacks the model and data sections, refuses an unresolved auto naming the field."""
    from colossal_hetero.planner.tp2d_choice import resolved_tp_mode
    from colossal_hetero.preflight import validate_layout
    from colossal_hetero.train import with_tp_mode_resolved

    config = _run({"tp_mode": "auto"})
    resolved = with_tp_mode_resolved(config, 4)
    assert resolved.parallel.tp_mode == resolved_tp_mode(config, 4) in ("1d", "2d")
    assert with_tp_mode_resolved(_run(), 4).parallel.tp_mode == "2d"  # given modes stay
    with pytest.raises(ConfigError, match=r"^parallel\.tp_mode: auto is chosen"):
        validate_layout(config.plugin_config(), 4)
