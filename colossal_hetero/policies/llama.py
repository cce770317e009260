"""Resizable TP policy for transformers' LlamaForCausalLM.

Widths: ``heads`` (query heads; q_proj and o_proj), from which each rank's key/value heads
follow (heads / (num_attention_heads / num_key_value_heads), so counts are multiples of the
query-group size; zero is allowed, see policies.zero_heads), ``ffn`` (gate_proj, up_proj,
down_proj) and ``vocab`` (embed_tokens, lm_head).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from colossalai.shardformer.policies.base_policy import ModulePolicyDescription
from colossalai.shardformer.policies.llama import LlamaForCausalLMPolicy

from colossal_hetero.layers import (
    ResizableLinearCol,
    ResizableLinearRow,
    ResizableLMHead,
    ResizableVocabEmbedding,
)
from colossal_hetero.policies.base import LayerSpec, ResizablePolicy
from colossal_hetero.policies.forwards import lm_forward_with_uneven_loss
from colossal_hetero.policies.zero_heads import llama_attention_forward


class ResizableLlamaForCausalLMPolicy(ResizablePolicy, LlamaForCausalLMPolicy):
    """LlamaForCausalLMPolicy with per-rank ``heads``, ``ffn`` and ``vocab`` widths."""

    def _group_size(self) -> int:
        config = self.model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return config.num_attention_heads // kv_heads

    def width_totals(self) -> dict[str, int]:
        config = self.model.config
        return {
            "heads": config.num_attention_heads,
            "ffn": config.intermediate_size,
            "vocab": config.vocab_size,
        }

    def width_units(self) -> dict[str, int]:
        return {"heads": self._group_size()}

    def min_widths(self) -> dict[str, int]:
        return {"heads": 0}  # zero_heads.llama_attention_forward runs a rank with none

    def head_dim(self) -> int:
        config = self.model.config
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def feature_widths(self, key: str, widths: Mapping[str, Sequence[int]]) -> tuple[int, ...]:
        if key == "kv_heads":
            return tuple(h // self._group_size() * self.head_dim() for h in widths["heads"])
        return super().feature_widths(key, widths)

    def layer_specs(self) -> list[LayerSpec]:
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaForCausalLM,
            LlamaModel,
        )

        block = LlamaDecoderLayer
        return [
            LayerSpec(block, "self_attn.q_proj", ResizableLinearCol, "heads"),
            LayerSpec(block, "self_attn.k_proj", ResizableLinearCol, "kv_heads"),
            LayerSpec(block, "self_attn.v_proj", ResizableLinearCol, "kv_heads"),
            LayerSpec(block, "self_attn.o_proj", ResizableLinearRow, "heads"),
            LayerSpec(block, "mlp.gate_proj", ResizableLinearCol, "ffn"),
            LayerSpec(block, "mlp.up_proj", ResizableLinearCol, "ffn"),
            LayerSpec(block, "mlp.down_proj", ResizableLinearRow, "ffn"),
            LayerSpec(LlamaModel, "embed_tokens", ResizableVocabEmbedding, "vocab"),
            LayerSpec(LlamaForCausalLM, "lm_head", ResizableLMHead, "vocab"),
        ]

    def attribute_values(self, local: Mapping[str, int]) -> dict[type, dict[str, Any]]:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        heads = local["heads"]
        return {
            LlamaDecoderLayer: {
                "self_attn.hidden_size": heads * self.head_dim(),
                "self_attn.num_heads": heads,
                "self_attn.num_key_value_heads": heads // self._group_size(),
            }
        }

    def replace_forwards(self, policy: dict) -> None:
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaForCausalLM

        self.wrap_forward(policy, LlamaAttention, llama_attention_forward)

        description = policy.setdefault(LlamaForCausalLM, ModulePolicyDescription())
        methods = dict(description.method_replacement or {})
        stock = methods.get("forward", LlamaForCausalLM.forward)
        methods["forward"] = partial(lm_forward_with_uneven_loss, stock=stock)
        description.method_replacement = methods
