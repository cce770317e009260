"""Resizable TP policy for transformers' BertForMaskedLM.

Widths: ``heads`` (query, key, value; attention.output.dense), ``ffn`` (intermediate.dense,
output.dense) and ``vocab`` (word_embeddings and the tied MLM decoder, whose logits are
gathered, so transformers' own loss over full logits stays exact).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colossalai.shardformer.policies.bert import BertForMaskedLMPolicy

from colossal_hetero.layers import (
    ResizableLinearCol,
    ResizableLinearRow,
    ResizableLMHead,
    ResizableVocabEmbedding,
)
from colossal_hetero.policies.base import LayerSpec, ResizablePolicy


class ResizableBertForMaskedLMPolicy(ResizablePolicy, BertForMaskedLMPolicy):
    """BertForMaskedLMPolicy with per-rank ``heads``, ``ffn`` and ``vocab`` widths."""

    def width_totals(self) -> dict[str, int]:
        config = self.model.config
        return {
            "heads": config.num_attention_heads,
            "ffn": config.intermediate_size,
            "vocab": config.vocab_size,
        }

    def layer_specs(self) -> list[LayerSpec]:
        from transformers.models.bert.modeling_bert import (
            BertEmbeddings,
            BertLayer,
            BertLMPredictionHead,
        )

        return [
            LayerSpec(BertLayer, "attention.self.query", ResizableLinearCol, "heads"),
            LayerSpec(BertLayer, "attention.self.key", ResizableLinearCol, "heads"),
            LayerSpec(BertLayer, "attention.self.value", ResizableLinearCol, "heads"),
            LayerSpec(BertLayer, "attention.output.dense", ResizableLinearRow, "heads"),
            LayerSpec(BertLayer, "intermediate.dense", ResizableLinearCol, "ffn"),
            LayerSpec(BertLayer, "output.dense", ResizableLinearRow, "ffn"),
            LayerSpec(BertEmbeddings, "word_embeddings", ResizableVocabEmbedding, "vocab"),
            LayerSpec(BertLMPredictionHead, "decoder", ResizableLMHead, "vocab"),
        ]

    def attribute_values(self, local: Mapping[str, int]) -> dict[type, dict[str, Any]]:
        from transformers.models.bert.modeling_bert import BertLayer

        heads, width = local["heads"], local["heads"] * self.head_dim()
        values = {}
        for attention in ("attention", "crossattention"):
            values[f"{attention}.self.all_head_size"] = width
            values[f"{attention}.self.num_attention_heads"] = heads
        return {BertLayer: values}
