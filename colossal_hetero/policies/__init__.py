"""Shardformer policies for uneven (resizable) tensor parallelism.

Each subclasses Colossal-AI's stock policy for the model (keeping its pipeline forwards) and
replaces the TP layers by the resizable ones with per-rank ``widths``::

    policy = resizable_policy(model, {"heads": [3, 1], "ffn": [96, 32], "vocab": [200, 56]})
    plugin = HeteroParallelPlugin(config, policy=policy)
    ...
    policy.resize({"heads": [2, 2]}, optimizer=optimizer)   # between steps, lossless
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from colossal_hetero.policies.base import LayerSpec, ResizablePolicy
from colossal_hetero.policies.bert import ResizableBertForMaskedLMPolicy
from colossal_hetero.policies.gpt2 import ResizableGPT2LMHeadPolicy
from colossal_hetero.policies.llama import ResizableLlamaForCausalLMPolicy
from colossal_hetero.policies.vit import ResizableViTForImageClassificationPolicy
from colossal_hetero.policies.widths import even_widths, resolve_widths

_POLICIES: dict[str, type[ResizablePolicy]] = {
    "GPT2LMHeadModel": ResizableGPT2LMHeadPolicy,
    "LlamaForCausalLM": ResizableLlamaForCausalLMPolicy,
    "BertForMaskedLM": ResizableBertForMaskedLMPolicy,
    "ViTForImageClassification": ResizableViTForImageClassificationPolicy,
}


def resizable_policy(
    model: nn.Module,
    widths: Mapping[str, Sequence[int]] | None = None,
    *,
    align: Mapping[str, int] | None = None,
) -> ResizablePolicy:
    """The resizable policy for ``model``'s class with per-rank ``widths`` (see ResizablePolicy)."""
    name = type(model).__name__
    if name not in _POLICIES:
        raise ValueError(f"no resizable policy for {name}; supported: {sorted(_POLICIES)}")
    return _POLICIES[name](widths, align=align)


__all__ = [
    "LayerSpec",
    "ResizableBertForMaskedLMPolicy",
    "ResizableGPT2LMHeadPolicy",
    "ResizableLlamaForCausalLMPolicy",
    "ResizablePolicy",
    "ResizableViTForImageClassificationPolicy",
    "even_widths",
    "resizable_policy",
    "resolve_widths",
]
