"""Attention forwards for a rank that holds no attention heads (a zero-width head shard).

transformers' attention forwards infer the local head count from the projection's width
(``view(..., -1, head_dim)``, ``split(split_size)``), which a zero-width shard makes ambiguous.
A rank with no heads still runs every projection, so every collective keeps its shape and
order: the column-parallel QKV layers (whose backward all-reduces the input gradient; this
rank adds zeros) and the row-parallel output layer (whose forward all-reduce gets zeros from
this rank). Their empty outputs feed the output projection, which keeps the QKV layers on the
autograd path so their backward collectives run too. The attention core (scores, softmax,
context) is skipped: it has nothing to compute.

The width is read at call time, so ``plugin.resize`` into and out of zero heads needs no
rebinding. Ranks with heads run the stock forward unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def gpt2_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    layer_past: Any = None,
    attention_mask: torch.Tensor | None = None,
    head_mask: torch.Tensor | None = None,
    encoder_hidden_states: torch.Tensor | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    use_cache: bool | None = False,
    output_attentions: bool | None = False,
    *,
    stock: Callable[..., Any],
    **kwargs: Any,
) -> tuple[Any, ...]:
    """GPT2Attention forward; with no local heads, ``c_proj(c_attn(x))`` on empty shards."""
    if self.c_attn.local_width:
        return stock(  # type: ignore[no-any-return]
            self,
            hidden_states,
            layer_past,
            attention_mask,
            head_mask,
            encoder_hidden_states,
            encoder_attention_mask,
            use_cache,
            output_attentions,
            **kwargs,
        )
    if encoder_hidden_states is not None:
        raise ValueError("a rank with no attention heads does not support cross attention")
    fused = self.c_attn(hidden_states)  # [B, T, 0]: Q|K|V of no heads
    output = self.resid_dropout(self.c_proj(fused))
    present = None
    if use_cache:
        empty = _empty_heads(fused, self.head_dim)
        if layer_past is not None:
            empty = torch.cat((layer_past[0], empty), dim=-2)
        present = (empty, empty)
    return (output, present, None) if output_attentions else (output, present)


def llama_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_value: Any = None,
    cache_position: torch.Tensor | None = None,
    *,
    stock: Callable[..., Any],
    **kwargs: Any,
) -> tuple[Any, ...]:
    """LlamaAttention forward; with no local heads, ``o_proj`` of the empty q|k|v shards."""
    if self.q_proj.local_width:
        return stock(  # type: ignore[no-any-return]
            self,
            hidden_states,
            position_embeddings,
            attention_mask,
            past_key_value,
            cache_position,
            **kwargs,
        )
    parts = [proj(hidden_states) for proj in (self.q_proj, self.k_proj, self.v_proj)]
    if past_key_value is not None:
        _extend_empty_cache(past_key_value, self.layer_idx, parts[1], self.head_dim)
    return self.o_proj(torch.cat(parts, dim=-1)), None


def _extend_empty_cache(cache: Any, layer_idx: int, local: torch.Tensor, head_dim: int) -> None:
    """Grow this layer's cache entry of no heads by ``local``'s positions.

    transformers' DynamicCache takes an entry with no elements for a skipped layer: ``update``
    replaces it instead of appending, which would keep only the newest positions. So the entry
    passed is the whole empty history, [B, 0, cached + new, head_dim]: its shape keeps the
    position count in step with the ranks that hold heads. (The cache's ``get_seq_length()``
    still reads 0 on this rank, as transformers counts an entry with no elements as empty; the
    positions derived from it feed only the attention core this rank skips, but a caller that
    needs the cache's length should read it on a rank with heads, or pass ``cache_position``.)
    """
    keys = getattr(cache, "key_cache", [])
    held = len(keys) > layer_idx and keys[layer_idx].dim() == 4
    cached = keys[layer_idx].shape[-2] if held else 0
    empty = local.new_empty(local.shape[0], 0, cached + local.shape[-2], head_dim)
    cache.update(empty, empty, layer_idx)


def _empty_heads(local: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, T, 0] -> [B, 0, T, head_dim]: the key/value cache entry of no heads."""
    return local.reshape(*local.shape[:-1], 0, head_dim).transpose(1, 2)
