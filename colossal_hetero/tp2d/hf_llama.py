"""A Hugging Face ``LlamaForCausalLM`` converted in place to 2D layers (the plugin's path).

As ``hf_gpt2``: the HF module tree, names and parameter objects stay; every ``nn.Linear``
becomes a Linear2D holding this rank's block of the transposed weight ([in, out]; its hooks
gather back to HF's [out, in]), every RMSNorm an RMSNorm2D, the embedding an Embedding2D,
``lm_head`` an LMHead2D (tied to the embedding when the config ties them). Mesh column j
holds ``head_counts[j]`` query heads and the same fraction of the key/value heads (grouped
query attention), so the HF attention runs unchanged on its local heads with rotary position
embeddings of the full sequence; the causal mask is passed explicitly.

``forward(input_ids, attention_mask=None, labels=None)``: as ``GPT2LMHeadModel2D.forward``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from colossal_hetero.tp2d.gpt2 import GPT2Shares
from colossal_hetero.tp2d.hf_gpt2 import adopt, check_inputs, run_head, split_rows
from colossal_hetero.tp2d.layers import Embedding2D, Linear2D, LMHead2D, RMSNorm2D, dense_block
from colossal_hetero.tp2d.layout import head_widths
from colossal_hetero.tp2d.mesh import Mesh2D
from colossal_hetero.tp2d.state import BlockSpec, install_full_state_dict, mark


def check_llama(config: Any, q: int, shares: GPT2Shares) -> tuple[int, ...]:
    """Key/value heads per mesh column; ValueError naming the field when Llama does not fit."""
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("model.hf.attention_bias/mlp_bias: 2D Llama supports no biases")
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError("model.hf.attention_dropout: 2D Llama needs dropout 0")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim * heads != config.hidden_size:
        raise ValueError("model.hf.head_dim: 2D Llama needs hidden_size = heads x head_dim")
    if any(a * kv_heads % heads for a in shares.head_counts):
        raise ValueError(
            f"model.hf.num_key_value_heads: {kv_heads} key/value heads do not follow the "
            f"query heads {list(shares.head_counts)} per mesh column"
        )
    return tuple(a * kv_heads // heads for a in shares.head_counts)


def _linear(mesh: Mesh2D, linear: nn.Linear, rows: tuple, cols: tuple) -> Linear2D:
    layer = Linear2D(mesh, rows, cols, bias=False, dtype=linear.weight.dtype)
    layer.load_dense(linear.weight.detach().t())
    return adopt(layer, linear, {"weight": BlockSpec(mesh, rows, cols, transpose=True)})


def _rms(mesh: Mesh2D, norm: Any, widths: tuple) -> RMSNorm2D:
    new = RMSNorm2D(mesh, widths, eps=norm.variance_epsilon, dtype=norm.weight.dtype)
    new.load_dense(norm.weight.detach())
    return adopt(new, norm, {"weight": BlockSpec(mesh, None, widths)})


def _convert_layer(layer: Any, mesh: Mesh2D, widths: tuple, kv: tuple, ffn: tuple) -> None:
    layer.input_layernorm = _rms(mesh, layer.input_layernorm, widths)
    layer.post_attention_layernorm = _rms(mesh, layer.post_attention_layernorm, widths)
    attn = layer.self_attn
    attn.q_proj = _linear(mesh, attn.q_proj, widths, widths)
    attn.k_proj = _linear(mesh, attn.k_proj, widths, kv)
    attn.v_proj = _linear(mesh, attn.v_proj, widths, kv)
    attn.o_proj = _linear(mesh, attn.o_proj, widths, widths)
    mlp = layer.mlp
    mlp.gate_proj = _linear(mesh, mlp.gate_proj, widths, ffn)
    mlp.up_proj = _linear(mesh, mlp.up_proj, widths, ffn)
    mlp.down_proj = _linear(mesh, mlp.down_proj, ffn, widths)


class LlamaForCausalLM2D(nn.Module):
    """Llama LM on a q x q mesh with HF names (see the module docstring)."""

    def __init__(self, hf_model: Any, mesh: Mesh2D, shares: GPT2Shares) -> None:
        super().__init__()
        config = hf_model.config
        kv_heads = check_llama(config, mesh.q, shares)
        self.config, self.mesh, self.shares = config, mesh, shares
        head_dim = config.hidden_size // config.num_attention_heads
        widths = head_widths(shares.head_counts, head_dim)
        kv = head_widths(kv_heads, head_dim)
        vocab = tuple(shares.vocab_sizes)
        dense = hf_model.model
        embed = Embedding2D(mesh, vocab, widths, dtype=dense.embed_tokens.weight.dtype)
        embed.load_dense(dense.embed_tokens.weight.detach())
        spec = BlockSpec(mesh, vocab, widths)
        dense.embed_tokens = adopt(embed, dense.embed_tokens, {"weight": spec})
        for layer in dense.layers:
            _convert_layer(layer, mesh, widths, kv, tuple(shares.ffn_sizes))
        dense.norm = _rms(mesh, dense.norm, widths)
        self.model = dense
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head = LMHead2D(mesh, vocab, widths, weight=dense.embed_tokens.weight)
        else:
            head = LMHead2D(mesh, vocab, widths, weight=None)
            param = hf_model.lm_head.weight
            param.data = dense_block(param.detach(), vocab, widths, mesh.i, mesh.j)
            head.weight = param
            mark(param, spec)
            self.lm_head = head
        install_full_state_dict(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        check_inputs(attention_mask, kwargs, "Llama")
        batch, seq = input_ids.shape
        sizes = split_rows(self.shares, self.mesh.q, batch)
        dense = self.model
        hidden = dense.embed_tokens(input_ids, sizes)
        positions = torch.arange(seq, device=input_ids.device).expand(hidden.shape[0], seq)
        rotary = dense.rotary_emb(hidden, positions)
        lowest = torch.finfo(hidden.dtype).min
        blocked = torch.full((seq, seq), lowest, dtype=hidden.dtype, device=hidden.device)
        causal = blocked.triu(1)[None, None]  # explicit: eager and sdpa alike
        for layer in dense.layers:
            hidden = layer(
                hidden, attention_mask=causal, position_ids=positions, position_embeddings=rotary
            )[0]
        loss, logits = run_head(self.lm_head, dense.norm(hidden), labels, self.mesh, sizes)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
