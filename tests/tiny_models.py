"""Tiny model configs shared by the distributed tests of resizable (uneven-width) layers.

Widths divide unevenly on purpose; dropout is off so that runs compare exactly.
"""

from __future__ import annotations

from colossal_hetero.config import ModelConfig

GPT2 = ModelConfig(
    arch="gpt2",
    hf={
        "n_layer": 2,
        "n_embd": 32,
        "n_head": 4,
        "n_inner": 96,
        "n_positions": 32,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
)
# Grouped-query attention: 6 query heads in 3 key/value groups of 2.
LLAMA = ModelConfig(
    arch="llama",
    hf={
        "num_hidden_layers": 2,
        "hidden_size": 48,
        "intermediate_size": 64,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "max_position_embeddings": 32,
    },
)
