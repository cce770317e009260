"""ModelSpec from a torch.fx trace: agrees with the config path, counts a custom model by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from colossal_hetero.config import from_dict
from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.schema import HeteroConfig, RunConfig
from colossal_hetero.planner import (
    ClusterSpec,
    LayerKind,
    model_spec_from_fx,
    model_spec_from_hf,
    plan_for_run,
    search_plan,
)
from colossal_hetero.planner.resolve import plan_for_model
from tests.tolerances import FLOAT64_FORMULA_RTOL

transformers = pytest.importorskip("transformers")

# Small configs of every architecture the config path knows; Llama with grouped KV heads.
SMALL = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_layer": 2, "n_embd": 64, "n_head": 4,
                                               "n_positions": 64, "vocab_size": 256}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_hidden_layers": 2, "hidden_size": 64,
                                                  "num_attention_heads": 8,
                                                  "num_key_value_heads": 2,
                                                  "intermediate_size": 96,
                                                  "max_position_embeddings": 64,
                                                  "vocab_size": 256}),
    "bert": ("BertConfig", "BertForMaskedLM", {"num_hidden_layers": 2, "hidden_size": 64,
                                               "num_attention_heads": 4,
                                               "intermediate_size": 128,
                                               "max_position_embeddings": 64,
                                               "vocab_size": 320}),
    "vit": ("ViTConfig", "ViTForImageClassification", {"num_hidden_layers": 2, "hidden_size": 64,
                                                       "num_attention_heads": 4,
                                                       "intermediate_size": 128,
                                                       "image_size": 8, "patch_size": 2,
                                                       "num_channels": 1, "num_labels": 10}),
}  # fmt: skip


def _hf_model(arch: str) -> tuple[object, nn.Module]:
    config_name, model_name, attrs = SMALL[arch]
    config = getattr(transformers, config_name)(**attrs)
    with torch.device("meta"):  # the fx path reads shapes only
        model = getattr(transformers, model_name)(config)
    return config, model


@pytest.mark.parametrize("arch", sorted(SMALL))
def test_fx_spec_matches_the_config_path(arch):
    config, model = _hf_model(arch)
    fx_spec = model_spec_from_fx(model, batch_size=8, seq_len=32)
    hf_spec = model_spec_from_hf(config, batch_size=8, seq_len=32)
    assert [(la.kind, la.name, la.modules) for la in fx_spec.layers] == [
        (la.kind, la.name, la.modules) for la in hf_spec.layers
    ]
    # FLOPs agree exactly, not only within 1%: both count 2 per multiply-add of every linear
    # and attention matmul, and the same per-feature constants for norms, lookups and loss.
    # (Llama's rotary frequency matmul reads no activation and is left out by both.)
    for fx_layer, hf_layer in zip(fx_spec.layers, hf_spec.layers, strict=True):
        # Per-op float64 flop counts summed in another order: ~1e-15 apart; 1e-9 is loose.
        assert fx_layer.flops_per_token == pytest.approx(hf_layer.flops_per_token, rel=1e-9)
        assert fx_layer == hf_layer  # shards, heads, residual flags, tied weights, params
    assert fx_spec.num_params == hf_spec.num_params == sum(p.numel() for p in model.parameters())
    assert (fx_spec.seq_len, fx_spec.name) == (hf_spec.seq_len, hf_spec.name)


def test_fx_spec_reads_grouped_kv_heads():
    _, model = _hf_model("llama")
    spec = model_spec_from_fx(model, batch_size=2, seq_len=16)
    qkv = next(la for la in spec.layers if la.kind is LayerKind.ATTENTION_QKV)
    assert (qkv.num_heads, qkv.head_dim, qkv.out_features) == (2, 8, 64 + 2 * 2 * 8)
    assert qkv.modules == tuple(f"model.layers.0.self_attn.{x}_proj" for x in "qkv")


def test_live_model_weights_are_not_touched():
    config_name, model_name, attrs = SMALL["gpt2"]
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**attrs))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    spec = model_spec_from_fx(model, batch_size=4, seq_len=16)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.config.use_cache  # the trace changed a copy of the config


# A nanoGPT-style transformer the config path cannot read: fused QKV, explicit score and
# context matmuls, learned positions, tied head, loss in forward.
class _Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.out.in_features
        q, k, v = self.qkv(x).split(width, dim=2)  # fx traces unpacking, not loops over proxies
        q, k, v = (z.unflatten(-1, (self.heads, -1)).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(width // self.heads)
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).flatten(2))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = _Attention(width, heads)
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = 96, width: int = 32, heads: int = 4, depth: int = 2,
                 tokens: int = 16) -> None:  # fmt: skip
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(tokens, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.register_buffer("positions", torch.arange(tokens))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(self.positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _nano_spec(**kwargs):
    ids = torch.zeros(2, 16, dtype=torch.long)  # an example batch of 2: counts are per sample
    return model_spec_from_fx(NanoGPT(**kwargs), 8, example_inputs={"idx": ids, "targets": ids})


def test_custom_transformer_flops_equal_a_hand_count():
    spec = _nano_spec()
    v, d, t, depth = 96, 32, 16, 2
    # Per token: QKV 2*d*3d, scores + context 2 * 2*t*d, out 2*d*d, MLP 2 * 2*d*4d, two norms
    # 8*d each; then the lookup (d), final norm, tied head 2*d*v and cross entropy 4*v.
    block = 2 * d * 3 * d + 4 * t * d + 2 * d * d + 2 * 2 * d * 4 * d + 2 * 8 * d
    hand = depth * block + d + 8 * d + 2 * d * v + 4 * v
    assert sum(la.flops_per_token for la in spec.layers) == hand
    kinds = [la.kind for la in spec.layers]
    assert kinds[:8] == [
        LayerKind.EMBEDDING,
        LayerKind.NORM,
        LayerKind.ATTENTION_QKV,
        LayerKind.ATTENTION_CORE,
        LayerKind.ATTENTION_OUT,
        LayerKind.NORM,
        LayerKind.MLP_UP,
        LayerKind.MLP_DOWN,
    ]
    assert kinds[-2:] == [LayerKind.LM_HEAD, LayerKind.LOSS]
    by_name = {la.name: la for la in spec.layers}
    assert by_name["wte"].modules == ("wte", "wpe")
    assert by_name["wte"].replicated_params == t * d  # positions are not split
    assert by_name["head"].tied
    assert by_name["blocks.0.attn.core"].num_heads == 4
    assert by_name["blocks.0.ln_1"].opens_residual and by_name["blocks.0.attn.out"].closes_residual
    assert by_name["blocks.0.ln_2"].opens_residual and by_name["blocks.0.proj"].closes_residual
    assert spec.num_params == sum(p.numel() for p in NanoGPT().parameters())


def test_custom_transformer_plans_with_speed_proportional_widths():
    spec = _nano_spec(width=64, heads=8)
    cluster = ClusterSpec.from_relative([1.0, 0.5], bandwidth_gbps=1e6, latency_s=0.0)
    plan = search_plan(cluster, spec, tp_size=2, space="megatron")
    # Compute only (links this fast cost nothing): shares follow the 2:1 speeds, rounded to
    # whole heads (8 heads: 5.33 -> 5) and whole features.
    assert plan.tp_ratios == pytest.approx((2 / 3, 1 / 3), rel=FLOAT64_FORMULA_RTOL)
    assert plan.widths == {"heads": (5, 3), "ffn": (171, 85), "vocab": (64, 32)}
    assert plan.speedup > 1.3


def test_mlp_stack_without_attention():
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16), nn.Linear(16, 4))
    spec = model_spec_from_fx(mlp, 4, example_inputs={"input": torch.zeros(1, 16)})
    assert [la.kind for la in spec.layers] == [
        LayerKind.MLP_UP,
        LayerKind.MLP_DOWN,
        LayerKind.LINEAR,
    ]
    assert [la.name for la in spec.layers] == ["0", "2", "3"]
    assert [la.flops_per_token for la in spec.layers] == [2 * 16 * 64, 2 * 64 * 16, 2 * 16 * 4]


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def test_unclassifiable_layers_name_the_module_or_node():
    model = nn.Sequential(nn.Linear(8, 8), _Scaled())
    with pytest.raises(ValueError, match=r"module 1 \(_Scaled\) holds weights"):
        model_spec_from_fx(model, 1, example_inputs={"input": torch.zeros(1, 8)})

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    with pytest.raises(ValueError, match=r"node matmul .*weight outside a module"):
        model_spec_from_fx(Functional(), 1, example_inputs={"x": torch.zeros(1, 8)})
    with pytest.raises(ValueError, match="example_inputs is required for Sequential"):
        model_spec_from_fx(model, 1)
    with pytest.raises(ValueError, match=r"\['y'\] are not arguments"):
        model_spec_from_fx(model, 1, example_inputs={"y": torch.zeros(1, 8)})


def test_plan_config_switch_reaches_the_fx_reader():
    run = from_dict(
        RunConfig,
        {
            "model": {"arch": "gpt2", "hf": {"n_layer": 1, "n_embd": 64, "n_head": 4}},
            "data": {"seq_len": 32, "global_batch_size": 4},
            "parallel": {"tp": 2},
            "cluster": {"devices": [{"speed": 1.0}, {"speed": 0.5}]},
            "plan": {"model_spec": "fx"},
        },
    )
    assert run.plan.model_spec == "fx" and from_dict(RunConfig, {}).plan.model_spec == "hf"
    with pytest.raises(ConfigError, match="model_spec"):
        from_dict(RunConfig, {"plan": {"model_spec": "onnx"}})
    fx_plan = plan_for_run(run, 2)
    hf_run = from_dict(RunConfig, {**_as_dict(run), "plan": {"model_spec": "hf"}})
    hf_plan = plan_for_run(hf_run, 2)
    assert fx_plan.widths == hf_plan.widths
    assert fx_plan.step_time == pytest.approx(hf_plan.step_time, rel=FLOAT64_FORMULA_RTOL)

    config = from_dict(HeteroConfig, {"parallel": {"tp": 2}, "cluster": _as_dict(run)["cluster"],
                                      "plan": {"model_spec": "fx"}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"plan.model_spec: fx: example_inputs is required"):
        plan_for_model(config, nn.Sequential(nn.Linear(8, 8), _Scaled()), 2, (4, 8))


def _as_dict(run: RunConfig) -> dict:
    return {
        "model": {"arch": run.model.arch, "hf": dict(run.model.hf)},
        "data": {"seq_len": run.data.seq_len, "global_batch_size": run.data.global_batch_size},
        "parallel": {"tp": run.parallel.tp},
        "cluster": {"devices": [{"speed": d.speed} for d in run.cluster.devices]},
    }
