"""Tiny training configs and their tolerances, shared by the end-to-end trainer tests."""

from __future__ import annotations

import torch

from tests.tolerances import chain_atol, transformer_depth

# A loss computed at other TP widths from the same weights: the forward reduction chain of the
# 2-layer model, sums of at most 256 terms (the byte vocabulary), relative to the loss.
# Later steps are not compared across widths: Adam turns the rounding noise of near-zero
# gradients into O(lr) weight differences (tests/tolerances.py); resumes at the same widths
# are checked bitwise instead. Also the first loss on another device from the same weights.
FORWARD_RTOL = chain_atol(transformer_depth(2, backward=False), 256, torch.float32, 1.0)

TINY_GPT2 = {
    "model": {
        "arch": "gpt2",
        "hf": {
            "n_layer": 2,
            "n_embd": 32,
            "n_head": 4,
            "n_positions": 32,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    },
    "data": {"dataset": "pydoc_topics", "seq_len": 32, "global_batch_size": 8},
    "parallel": {"tp": 2, "pp": 2, "num_microbatches": 2},
    "cluster": {"device": "cpu"},
    "optimizer": {"name": "adamw", "lr": 0.01},
    "train": {"steps": 8, "eval_every": 4, "eval_batches": 2},
    "logging": {"progress": False, "plot": False},
}


def with_sections(config: dict, **sections) -> dict:
    """A copy of ``config`` with each named section updated key by key."""
    merged = {key: dict(value) for key, value in config.items()}
    for key, value in sections.items():
        merged[key] = {**merged.get(key, {}), **value}
    return merged
