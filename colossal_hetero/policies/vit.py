"""Resizable TP policy for transformers' ViTForImageClassification.

Widths: ``heads`` (query, key, value; attention.output.dense) and ``ffn``
(intermediate.dense, output.dense). The classifier stays replicated: the stock policy's
column-parallel classifier is left out (as the planner's model of the head assumes), so any
number of classes works at any width and no balancer op ever touches the head.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colossalai.shardformer.policies.vit import ViTForImageClassificationPolicy

from colossal_hetero.layers import ResizableLinearCol, ResizableLinearRow
from colossal_hetero.policies.base import LayerSpec, ResizablePolicy


class ResizableViTForImageClassificationPolicy(ResizablePolicy, ViTForImageClassificationPolicy):
    """ViTForImageClassificationPolicy with per-rank ``heads`` and ``ffn`` widths."""

    def module_policy(self) -> dict:
        """The resizable description without the stock split of the classifier: every TP
        rank holds the whole head, computes the same logits from the same [CLS] state and
        gets the same gradient, so the replicas stay equal without a collective."""
        from transformers.models.vit.modeling_vit import ViTForImageClassification

        policy = super().module_policy()
        head = policy.get(ViTForImageClassification)
        if head is not None and head.sub_module_replacement:
            head.sub_module_replacement = [
                item for item in head.sub_module_replacement if item.suffix != "classifier"
            ]
        return policy

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
