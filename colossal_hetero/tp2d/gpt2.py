"""A Hugging Face GPT-2 LM on a q x q mesh: the model-level piece a 2D shardformer policy needs.

``GPT2LM2D(hf_model, mesh, shares)`` takes a dense ``GPT2LMHeadModel`` (same weights on every
rank) and keeps only this rank's blocks: ``wte`` becomes an Embedding2D, ``wpe`` a position
table [P, h_j] replicated down mesh column j, every LayerNorm a LayerNorm2D, ``c_attn`` /
``c_proj`` / ``c_fc`` Linear2D (Conv1D weights are [in, out] already; ``c_attn`` has the three
fused parts [Q | K | V]); the HF attention module runs unchanged on its a_j local heads
(``split_size`` and ``num_heads`` set to the column's), ``gelu_new`` becomes the one-kernel
tanh GELU (same formula, keeps only its input: ``lean_activation``), and the tied LM head is
an LMHead2D with the vocab-parallel cross-entropy.

``forward(input_ids [B, S], labels [B, S])`` takes the full batch (replicated over the mesh)
and returns the mean next-token loss over the global batch, the same on every rank (labels are
shifted as in ``GPT2LMHeadModel``; -100 is ignored). Not supported: attention masks, past key
values, cross-attention, dropout in training (p must be 0, since each rank would draw its own
masks), ``reorder_and_upcast_attn``; each raises a ValueError naming the setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from colossal_hetero.tp2d.layers import (
    Embedding2D,
    LayerNorm2D,
    Linear2D,
    LMHead2D,
    column_shared,
    dense_vector_block,
    split_batch_2d,
    vocab_cross_entropy_2d,
)
from colossal_hetero.tp2d.layout import check_sizes, head_widths
from colossal_hetero.tp2d.mesh import Mesh2D


@dataclass(frozen=True)
class GPT2Shares:
    """Block sizes: batch share per mesh row, heads, MLP width and vocab block per column."""

    batch_sizes: tuple[int, ...]
    head_counts: tuple[int, ...]
    ffn_sizes: tuple[int, ...]
    vocab_sizes: tuple[int, ...]


def check_gpt2(config: Any, shares: GPT2Shares, q: int) -> None:
    """ValueError naming the field when the model or the sizes do not fit 2D (on every rank)."""
    if getattr(config, "model_type", None) != "gpt2":
        raise ValueError(f"parallel.tp_mode: 2d supports GPT-2 only, got {config.model_type!r}")
    dropouts = {"resid_pdrop", "embd_pdrop", "attn_pdrop"}
    if any(getattr(config, name, 0.0) for name in dropouts):
        raise ValueError(f"model.{sorted(dropouts)}: 2D GPT-2 needs dropout 0")
    if getattr(config, "reorder_and_upcast_attn", False) or getattr(
        config, "add_cross_attention", False
    ):
        raise ValueError(
            "model: 2D GPT-2 supports neither reorder_and_upcast_attn nor cross-attention"
        )
    ffn = config.n_inner or 4 * config.n_embd
    check_sizes(shares.head_counts, q, name="parallel.tp2d.head_counts", total=config.n_head)
    check_sizes(shares.ffn_sizes, q, name="parallel.tp2d.ffn_sizes", total=ffn)
    check_sizes(shares.vocab_sizes, q, name="parallel.tp2d.vocab_sizes", total=config.vocab_size)
    check_sizes(shares.batch_sizes, q, name="parallel.tp2d.batch_sizes")


class PositionEmbedding2D(nn.Module):
    """Position table [P, h_j] replicated down column j: positions [S] -> [S, h_j]."""

    def __init__(self, mesh: Mesh2D, weight: torch.Tensor, widths: Sequence[int]) -> None:
        super().__init__()
        self.mesh = mesh
        self.weight = nn.Parameter(dense_vector_block(weight.detach(), widths, mesh.j))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions, column_shared(self.weight, self.mesh))


def _linear(
    mesh: Mesh2D, conv: Any, in_sizes: Sequence[int], out_sizes: Sequence[int], parts: int = 1
):
    layer = Linear2D(mesh, in_sizes, [parts * s for s in out_sizes], dtype=conv.weight.dtype)
    layer.load_dense(conv.weight.detach(), conv.bias.detach(), parts=parts)
    return layer


def _norm(mesh: Mesh2D, ln: nn.LayerNorm, widths: Sequence[int]) -> LayerNorm2D:
    norm = LayerNorm2D(mesh, widths, eps=ln.eps, dtype=ln.weight.dtype)
    norm.load_dense(ln.weight.detach(), ln.bias.detach())
    return norm


def _shard_block(block: Any, mesh: Mesh2D, shares: GPT2Shares, widths: Sequence[int]) -> None:
    """Replace one GPT2Block's submodules in place by this rank's 2D blocks."""
    block.ln_1 = _norm(mesh, block.ln_1, widths)
    block.ln_2 = _norm(mesh, block.ln_2, widths)
    attn = block.attn
    attn.c_attn = _linear(mesh, attn.c_attn, widths, widths, parts=3)
    attn.c_proj = _linear(mesh, attn.c_proj, widths, widths)
    attn.split_size = attn.embed_dim = widths[mesh.j]
    attn.num_heads = shares.head_counts[mesh.j]
    block.mlp.c_fc = _linear(mesh, block.mlp.c_fc, widths, shares.ffn_sizes)
    block.mlp.c_proj = _linear(mesh, block.mlp.c_proj, shares.ffn_sizes, widths)
    block.mlp.act = lean_activation(block.mlp.act)


def lean_activation(act: nn.Module) -> nn.Module:
    """The same activation, keeping only its input for the backward.

    GPT-2's ``gelu_new`` is the tanh GELU written as Python ops (``NewGELUActivation``),
    whose graph keeps four tensors of the MLP width (x^3, the tanh argument and output, a
    product); ``nn.GELU(approximate="tanh")`` computes the same formula in one kernel and keeps
    x only. Other activations are returned as they are.
    """
    if type(act).__name__ == "NewGELUActivation":
        return nn.GELU(approximate="tanh")
    return act


class GPT2LM2D(nn.Module):
    """GPT-2 LM on the mesh (see the module docstring). Consumes ``hf_model``'s modules."""

    def __init__(self, hf_model: Any, mesh: Mesh2D, shares: GPT2Shares) -> None:
        super().__init__()
        config = hf_model.config
        check_gpt2(config, shares, mesh.q)
        self.mesh, self.shares = mesh, shares
        widths = head_widths(shares.head_counts, config.n_embd // config.n_head)
        self.widths = widths
        dense = hf_model.transformer
        self.wte = Embedding2D(mesh, shares.vocab_sizes, widths, dtype=dense.wte.weight.dtype)
        self.wte.load_dense(dense.wte.weight.detach())
        self.wpe = PositionEmbedding2D(mesh, dense.wpe.weight, widths)
        for block in dense.h:
            _shard_block(block, mesh, shares, widths)
        self.h = dense.h
        self.ln_f = _norm(mesh, dense.ln_f, widths)
        self.head = LMHead2D(mesh, shares.vocab_sizes, widths, weight=self.wte.weight)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """input_ids, labels [B, S] (full, replicated) -> mean next-token loss (every rank)."""
        if input_ids.shape[0] != sum(self.shares.batch_sizes):
            raise ValueError(
                f"batch of {input_ids.shape[0]} does not match parallel.tp2d.batch_sizes "
                f"{list(self.shares.batch_sizes)}"
            )
        seq = input_ids.shape[1]
        positions = torch.arange(seq, device=input_ids.device)
        hidden = self.wte(input_ids, self.shares.batch_sizes) + self.wpe(positions)
        for block in self.h:
            hidden = block(hidden)[0]
        logits = self.head(self.ln_f(hidden)).reshape(hidden.shape[0], seq, -1)
        local_labels = split_batch_2d(labels, self.mesh, self.shares.batch_sizes, None)
        shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
        targets = local_labels[:, 1:].reshape(-1)
        return vocab_cross_entropy_2d(shifted, targets, self.mesh, self.shares.vocab_sizes)
