"""ModelSpec from transformers configs: parameter counts match the real models; plan_for_run."""

from __future__ import annotations

import sys
import types

import pytest

from colossal_hetero.config import from_dict
from colossal_hetero.config.schema import ModelConfig, RunConfig
from colossal_hetero.planner import LayerKind, ModelSpec, model_spec_from_hf, plan_for_run

TINY = {
    "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64},
    "llama": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "max_position_embeddings": 64,
    },
    "bert": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 64,
    },
    "vit": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 128,
    },
}

_LLAMA = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "num_hidden_layers": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}
_BERT_VIT = {
    "hidden_size": 768,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "intermediate_size": 3072,
}

# The default configs of transformers 4.51 (and Llama-3-8B), as plain attributes, with the
# parameter counts of the real models (counted on the meta device with transformers).
REFERENCE = [
    (
        {
            "model_type": "gpt2",
            "n_embd": 768,
            "n_head": 12,
            "n_layer": 12,
            "n_inner": None,
            "vocab_size": 50257,
            "n_positions": 1024,
            "tie_word_embeddings": True,
        },
        124_439_808,
    ),
    (_LLAMA, 6_738_415_616),
    (
        {**_LLAMA, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256},
        8_030_261_248,
    ),
    (
        {
            "model_type": "bert",
            **_BERT_VIT,
            "vocab_size": 30522,
            "max_position_embeddings": 512,
            "type_vocab_size": 2,
            "tie_word_embeddings": True,
        },
        109_514_298,
    ),
    (
        {
            "model_type": "vit",
            **_BERT_VIT,
            "image_size": 224,
            "patch_size": 16,
            "num_channels": 3,
            "qkv_bias": True,
            "num_labels": 2,
        },
        85_800_194,
    ),
]


@pytest.mark.parametrize(("attrs", "count"), REFERENCE, ids=lambda v: str(v)[:12])
def test_parameter_count_matches_transformers(attrs, count):
    spec = model_spec_from_hf(types.SimpleNamespace(**attrs), batch_size=1, seq_len=16)
    assert spec.num_params == count


def _spec(arch: str) -> tuple[ModelSpec, object]:
    from colossal_hetero.models import build_hf_config, build_model

    model_config = ModelConfig(arch=arch, hf=TINY[arch])
    spec = model_spec_from_hf(build_hf_config(model_config), batch_size=4, seq_len=32)
    return spec, build_model(model_config)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert", "vit"])
def test_parameter_count_and_module_names_match_built_models(arch):
    spec, model = _spec(arch)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    names = dict(model.named_modules())
    for layer in spec.layers:
        if layer.kind not in (LayerKind.ATTENTION_CORE, LayerKind.LOSS):
            assert all(m in names or m.rsplit(".", 1)[0] in names for m in layer.modules), layer


def test_llama_gqa_keeps_whole_kv_heads():
    attrs = {
        **_LLAMA,
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
    }
    spec = model_spec_from_hf(types.SimpleNamespace(**attrs), batch_size=4, seq_len=32)
    qkv = next(la for la in spec.layers if la.kind is LayerKind.ATTENTION_QKV)
    assert qkv.num_heads == 2 and qkv.out_shard.granularity == 8 * 4  # head_dim x q per kv head
    assert qkv.out_features == 64 + 2 * 2 * 8
    assert qkv.modules[-1].endswith("self_attn.v_proj")


def test_vit_uses_patch_tokens_and_bert_is_post_norm():
    vit_attrs = {**REFERENCE[4][0], "image_size": 8, "patch_size": 2, "num_channels": 1}
    vit = model_spec_from_hf(types.SimpleNamespace(**vit_attrs), batch_size=4, seq_len=999)
    assert vit.seq_len == (8 // 2) ** 2 + 1  # patches plus CLS; seq_len is ignored
    assert vit.layers[-1].tokens == 1  # the classifier reads the CLS token only
    bert = model_spec_from_hf(types.SimpleNamespace(**REFERENCE[3][0]), batch_size=4, seq_len=32)
    qkv = next(la for la in bert.layers if la.kind is LayerKind.ATTENTION_QKV)
    assert qkv.opens_residual  # post-norm: the block input is the skip branch


def test_unsupported_model_type():
    with pytest.raises(ValueError, match="model_type 't5' is not supported"):
        model_spec_from_hf(type("C", (), {"model_type": "t5"})(), batch_size=1, seq_len=8)


def test_plan_for_run_plans_the_configured_layout(monkeypatch):
    import colossal_hetero.models as models

    # The adapter's own logic, without importing every transformers model class (slow here).
    tiny = types.SimpleNamespace(**{**REFERENCE[0][0], **TINY["gpt2"], "vocab_size": 256})
    monkeypatch.setattr(models, "build_hf_config", lambda model_config: tiny)
    run = from_dict(
        RunConfig,
        {
            "model": {"arch": "gpt2", "hf": TINY["gpt2"]},
            "data": {"seq_len": 32, "global_batch_size": 12},
            "parallel": {"tp": 2},
            "cluster": {"devices": [{"speed": s} for s in (1.0, 0.5, 1.0, 1.0)]},
        },
    )
    plan = plan_for_run(run, 4)
    assert (plan.tp_size, plan.dp_size, plan.space) == (2, 2, "megatron")
    assert sum(plan.group_samples) == 12
    with pytest.raises(NotImplementedError, match="pp > 1"):
        plan_for_run(from_dict(RunConfig, {"parallel": {"tp": 2, "pp": 2}}), 4)


def test_planner_core_imports_no_torch():
    import subprocess

    code = (
        "import sys; import colossal_hetero.planner as p; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'leak'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
