"""Resizable TP policy for transformers' ViTForImageClassification.

Widths: ``heads`` (query, key, value; attention.output.dense) and ``ffn``
(intermediate.dense, output.dense). The classifier stays replicated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colossalai.shardformer.policies.vit import ViTForImageClassificationPolicy

from colossal_hetero.layers import ResizableLinearCol, ResizableLinearRow
from colossal_hetero.policies.base import LayerSpec, ResizablePolicy


class ResizableViTForImageClassificationPolicy(ResizablePolicy, ViTForImageClassificationPolicy):
    """ViTForImageClassificationPolicy with per-rank ``heads`` and ``ffn`` widths."""

    def width_totals(self) -> dict[str, int]:
        config = self.model.config
        return {"heads": config.num_attention_heads, "ffn": config.intermediate_size}

    def layer_specs(self) -> list[LayerSpec]:
        from transformers.models.vit.modeling_vit import ViTLayer

        return [
            LayerSpec(ViTLayer, "attention.attention.query", ResizableLinearCol, "heads"),
            LayerSpec(ViTLayer, "attention.attention.key", ResizableLinearCol, "heads"),
            LayerSpec(ViTLayer, "attention.attention.value", ResizableLinearCol, "heads"),
            LayerSpec(ViTLayer, "attention.output.dense", ResizableLinearRow, "heads"),
            LayerSpec(ViTLayer, "intermediate.dense", ResizableLinearCol, "ffn"),
            LayerSpec(ViTLayer, "output.dense", ResizableLinearRow, "ffn"),
        ]

    def attribute_values(self, local: Mapping[str, int]) -> dict[type, dict[str, Any]]:
        from transformers.models.vit.modeling_vit import ViTLayer

        return {
            ViTLayer: {
                "attention.attention.num_attention_heads": local["heads"],
                "attention.attention.all_head_size": local["heads"] * self.head_dim(),
            }
        }
