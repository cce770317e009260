"""A Hugging Face ``GPT2LMHeadModel`` converted in place to 2D layers (the plugin's path).

Unlike ``gpt2.GPT2LM2D`` (the model-level reference), the conversion keeps the HF module tree
and the parameter *objects*: each replaced module's parameters take this rank's block as their
data, so names are HF's (``transformer.h.0.attn.c_attn.weight``), an optimizer built on the
dense model before ``booster.boost`` steps the blocks, and every parameter carries shard and
gather hooks (tp2d/state.py) so checkpoints hold full HF tensors.

``forward(input_ids, attention_mask=None, labels=None)`` takes the batch of the mesh's
data-parallel group (the same on every rank of the mesh) and returns a
``CausalLMOutputWithCrossAttentions``: with labels, ``loss`` is the mean shifted next-token
loss over that batch (every rank; ``logits`` None: they are spread over the mesh); without,
``logits`` are the full [B, S, V] (gathered). Attention masks must be all ones (no padding).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

from colossal_hetero.tp2d.gpt2 import (
    GPT2Shares,
    PositionEmbedding2D,
    check_gpt2,
    lean_activation,
)
from colossal_hetero.tp2d.layers import (
    Embedding2D,
    LayerNorm2D,
    Linear2D,
    LMHead2D,
    gather_batch_2d,
    split_batch_2d,
    vocab_cross_entropy_2d,
)
from colossal_hetero.tp2d.layout import even_sizes, head_widths
from colossal_hetero.tp2d.mesh import Mesh2D
from colossal_hetero.tp2d.state import BlockSpec, install_full_state_dict, mark

_UNSUPPORTED_INPUTS = ("past_key_values", "inputs_embeds", "position_ids", "token_type_ids")


M = TypeVar("M", bound=nn.Module)


def adopt(new: M, old: nn.Module, specs: dict[str, BlockSpec]) -> M:
    """Give ``new``'s parameters ``old``'s parameter objects (with ``new``'s block as data),
    marked with their BlockSpec; returns ``new``."""
    for name, spec in specs.items():
        block = getattr(new, name)
        param = getattr(old, name)
        param.data = block.data
        setattr(new, name, param)
        mark(param, spec)
    return new


def _linear(mesh: Mesh2D, conv: Any, rows: tuple, cols: tuple, parts: int = 1) -> Linear2D:
    layer = Linear2D(mesh, rows, [parts * c for c in cols], dtype=conv.weight.dtype)
    layer.load_dense(conv.weight.detach(), conv.bias.detach(), parts=parts)
    specs = {
        "weight": BlockSpec(mesh, rows, cols, parts),
        "bias": BlockSpec(mesh, None, cols, parts),
    }
    return adopt(layer, conv, specs)


def _norm(mesh: Mesh2D, ln: nn.LayerNorm, widths: tuple) -> LayerNorm2D:
    norm = LayerNorm2D(mesh, widths, eps=ln.eps, dtype=ln.weight.dtype)
    norm.load_dense(ln.weight.detach(), ln.bias.detach())
    spec = BlockSpec(mesh, None, widths)
    return adopt(norm, ln, {"weight": spec, "bias": spec})


def _convert_block(block: Any, mesh: Mesh2D, shares: GPT2Shares, widths: tuple) -> None:
    """One GPT2Block's submodules replaced in place by this rank's 2D blocks."""
    ffn = tuple(shares.ffn_sizes)
    block.ln_1 = _norm(mesh, block.ln_1, widths)
    block.ln_2 = _norm(mesh, block.ln_2, widths)
    attn = block.attn
    attn.c_attn = _linear(mesh, attn.c_attn, widths, widths, parts=3)
    attn.c_proj = _linear(mesh, attn.c_proj, widths, widths)
    attn.split_size = attn.embed_dim = widths[mesh.j]
    attn.num_heads = shares.head_counts[mesh.j]
    block.mlp.c_fc = _linear(mesh, block.mlp.c_fc, widths, ffn)
    block.mlp.c_proj = _linear(mesh, block.mlp.c_proj, ffn, widths)
    block.mlp.act = lean_activation(block.mlp.act)  # same GELU, keeps only its input


class GPT2LMHeadModel2D(nn.Module):
    """GPT-2 LM on a q x q mesh with HF names (see the module docstring).

    ``shares.batch_sizes``: fixed batch shares per mesh row (the batch must then have their
    sum), or empty for an even split of whatever batch comes (divisible by q).
    """

    def __init__(self, hf_model: Any, mesh: Mesh2D, shares: GPT2Shares) -> None:
        super().__init__()
        config = hf_model.config
        check_gpt2(config, with_batch(shares, mesh.q), mesh.q)
        if not getattr(config, "tie_word_embeddings", True):
            raise ValueError("model.hf.tie_word_embeddings: 2D GPT-2 needs the tied LM head")
        self.config, self.mesh, self.shares = config, mesh, shares
        self.widths = widths = head_widths(shares.head_counts, config.n_embd // config.n_head)
        vocab = tuple(shares.vocab_sizes)
        dense = hf_model.transformer
        wte = Embedding2D(mesh, vocab, widths, dtype=dense.wte.weight.dtype)
        wte.load_dense(dense.wte.weight.detach())
        dense.wte = adopt(wte, dense.wte, {"weight": BlockSpec(mesh, vocab, widths)})
        wpe = PositionEmbedding2D(mesh, dense.wpe.weight, widths)
        dense.wpe = adopt(wpe, dense.wpe, {"weight": BlockSpec(mesh, None, widths)})
        for block in dense.h:
            _convert_block(block, mesh, shares, widths)
        dense.ln_f = _norm(mesh, dense.ln_f, widths)
        self.transformer = dense
        self.head = LMHead2D(mesh, vocab, widths, weight=dense.wte.weight)
        install_full_state_dict(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithCrossAttentions:
        check_inputs(attention_mask, kwargs, "GPT-2")
        batch, seq = input_ids.shape
        sizes = split_rows(self.shares, self.mesh.q, batch)
        dense = self.transformer
        positions = torch.arange(seq, device=input_ids.device)
        hidden = dense.wte(input_ids, sizes) + dense.wpe(positions)
        for block in dense.h:
            hidden = block(hidden)[0]
        loss, logits = run_head(self.head, dense.ln_f(hidden), labels, self.mesh, sizes)
        return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits)


def split_rows(shares: GPT2Shares, q: int, batch: int) -> tuple[int, ...]:
    """Samples per mesh row for a batch of ``batch`` (ValueError when it does not fit)."""
    fixed = tuple(shares.batch_sizes)
    if fixed:
        if sum(fixed) != batch:
            raise ValueError(
                f"a batch of {batch} samples does not match the plan's 2D batch shares "
                f"{list(fixed)} (per mesh row)"
            )
        return fixed
    if batch % q:
        raise ValueError(
            f"parallel.tp_mode: 2d splits each data-parallel batch evenly over the {q} mesh "
            f"rows; a batch of {batch} samples is not divisible"
        )
    return even_sizes(batch, q)


def run_head(
    head: LMHead2D,
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    mesh: Mesh2D,
    sizes: tuple[int, ...],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(loss, None) with labels: the mean shifted next-token loss over the whole batch, on
    every rank; (None, full logits [B, S, V]) without (gathered over the mesh)."""
    seq = hidden.shape[1]
    logits = head(hidden).reshape(hidden.shape[0], seq, -1)
    if labels is None:
        return None, gather_batch_2d(logits, mesh, sizes, head.vocab_sizes)
    local_labels = split_batch_2d(labels, mesh, sizes, None)
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
    targets = local_labels[:, 1:].reshape(-1)
    return vocab_cross_entropy_2d(shifted, targets, mesh, head.vocab_sizes), None


def with_batch(shares: GPT2Shares, q: int) -> GPT2Shares:
    """Shares with a placeholder batch split when the batch is split at run time."""
    if shares.batch_sizes:
        return shares
    return GPT2Shares((1,) * q, shares.head_counts, shares.ffn_sizes, shares.vocab_sizes)


def check_inputs(attention_mask: torch.Tensor | None, kwargs: dict[str, Any], what: str) -> None:
    """ValueError for inputs the 2D models do not take (before any collective)."""
    used = [k for k in _UNSUPPORTED_INPUTS if kwargs.get(k) is not None]
    if used:
        raise ValueError(f"2D {what} does not take {used}")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(f"2D {what} supports no padding: attention_mask must be all ones")
