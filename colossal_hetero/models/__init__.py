"""Hugging Face models built from YAML-sized configs with local random weights (no download).

Text models use a byte vocabulary (256 ids; BERT adds a mask id), ViT classifies 8x8 digits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.schema import ModelConfig

# Defaults that fit the bundled data; YAML `model.hf` overrides any of them.
_DATA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {"vocab_size": 256},
    "llama": {"vocab_size": 256},
    # The router's load-balancing loss is part of the training loss (router_aux_loss_coef).
    "mixtral": {"vocab_size": 256, "output_router_logits": True},
    # Byte ids 0..255 plus the mask id 256, rounded up so TP can split the vocabulary.
    "bert": {"vocab_size": 320},
    "vit": {"image_size": 8, "patch_size": 2, "num_channels": 1, "num_labels": 10},
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes that layout validation and planning need."""

    num_layers: int
    num_heads: int
    hidden_size: int
    max_positions: int


def _classes(arch: str) -> tuple[type, type]:
    import transformers as hf

    return {
        "gpt2": (hf.GPT2Config, hf.GPT2LMHeadModel),
        "llama": (hf.LlamaConfig, hf.LlamaForCausalLM),
        "mixtral": (hf.MixtralConfig, hf.MixtralForCausalLM),
        "bert": (hf.BertConfig, hf.BertForMaskedLM),
        "vit": (hf.ViTConfig, hf.ViTForImageClassification),
    }[arch]


def build_hf_config(model: ModelConfig) -> Any:
    """The transformers config for ``model``; unknown ``model.hf`` keys raise ConfigError."""
    config_cls, _ = _classes(model.arch)
    reference = config_cls()
    for key in model.hf:
        if not hasattr(reference, key):
            raise ConfigError(f"model.hf.{key}: not a field of transformers.{config_cls.__name__}")
    return config_cls(**{**_DATA_DEFAULTS[model.arch], **model.hf})


def model_shape(model: ModelConfig) -> ModelShape:
    """Layer, head, width and position counts of the configured model."""
    config = build_hf_config(model)
    return ModelShape(
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        hidden_size=config.hidden_size,
        max_positions=getattr(config, "max_position_embeddings", 0) or 0,
    )


def build_model(model: ModelConfig) -> nn.Module:
    """A freshly initialised model; identical on every rank (seeded by ``model.init_seed``).

    The global RNG is restored afterwards so initialisation does not shift later randomness.
    """
    config = build_hf_config(model)
    _, model_cls = _classes(model.arch)
    state = torch.get_rng_state()
    try:
        torch.manual_seed(model.init_seed)
        module = model_cls(config)
    finally:
        torch.set_rng_state(state)
    return module


def loss_from_outputs(outputs: Any, inputs: Any) -> torch.Tensor:
    """Colossal-AI criterion ``(outputs, inputs) -> loss``: the model computed it from labels."""
    return outputs.loss
