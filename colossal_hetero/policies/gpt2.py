"""Resizable TP policy for transformers' GPT2LMHeadModel.

Widths: ``heads`` (c_attn is fused Q|K|V, split head by head; c_proj rows), ``ffn`` (c_fc,
mlp.c_proj) and ``vocab`` (wte and the tied lm_head share one shard). A rank may hold no
heads (policies.zero_heads runs its attention). GPT-2 must run with eager attention under
shardformer forwards (the plugin switches it; see colossal_hetero.compat.attention).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from colossalai.shardformer.policies.base_policy import ModulePolicyDescription
from colossalai.shardformer.policies.gpt2 import GPT2LMHeadModelPolicy

from colossal_hetero.layers import (
    ResizableConv1DCol,
    ResizableConv1DRow,
    ResizableLMHead,
    ResizableVocabEmbedding,
)
from colossal_hetero.policies.base import LayerSpec, ResizablePolicy
from colossal_hetero.policies.forwards import gpt2_lm_forward
from colossal_hetero.policies.zero_heads import gpt2_attention_forward


class ResizableGPT2LMHeadPolicy(ResizablePolicy, GPT2LMHeadModelPolicy):
    """GPT2LMHeadModelPolicy with per-rank ``heads``, ``ffn`` and ``vocab`` widths."""

    def width_totals(self) -> dict[str, int]:
        config = self.model.config
        return {
            "heads": config.n_head,
            "ffn": config.n_inner or 4 * config.n_embd,
            "vocab": config.vocab_size,
        }

    def min_widths(self) -> dict[str, int]:
        return {"heads": 0}  # zero_heads.gpt2_attention_forward runs a rank with none

    def layer_specs(self) -> list[LayerSpec]:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2LMHeadModel, GPT2Model

        return [
            LayerSpec(GPT2Block, "attn.c_attn", ResizableConv1DCol, "heads", {"num_parts": 3}),
            LayerSpec(GPT2Block, "attn.c_proj", ResizableConv1DRow, "heads"),
            LayerSpec(GPT2Block, "mlp.c_fc", ResizableConv1DCol, "ffn"),
            LayerSpec(GPT2Block, "mlp.c_proj", ResizableConv1DRow, "ffn"),
            LayerSpec(GPT2Model, "wte", ResizableVocabEmbedding, "vocab"),
            LayerSpec(GPT2LMHeadModel, "lm_head", ResizableLMHead, "vocab"),
        ]

    def attribute_values(self, local: Mapping[str, int]) -> dict[type, dict[str, Any]]:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        width = local["heads"] * self.head_dim()
        return {
            GPT2Block: {
                "attn.embed_dim": width,
                "attn.split_size": width,
                "attn.num_heads": local["heads"],
            }
        }

    def replace_forwards(self, policy: dict) -> None:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2LMHeadModel

        self.wrap_forward(policy, GPT2Attention, gpt2_attention_forward)

        description = policy.setdefault(GPT2LMHeadModel, ModulePolicyDescription())
        methods = dict(description.method_replacement or {})
        stock = methods.get("forward")
        # Keep what Colossal-AI bound (stage manager, stage index, shard config).
        bound = dict(stock.keywords) if isinstance(stock, partial) else {}
        bound.setdefault("shard_config", self.shard_config)
        methods["forward"] = partial(gpt2_lm_forward, **bound)
        description.method_replacement = methods
