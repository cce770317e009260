"""A Hugging Face ``ViTForImageClassification`` converted in place to 2D layers.

As ``hf_gpt2``: HF names and parameter objects stay. The patch embedding (a convolution with
stride = kernel) is a Linear2D on the unfolded patches [B, N, C p p] (input features split
evenly over mesh columns, weight [C p p, H] cut [in_i, h_j]; its hooks reshape back to HF's
[H, C, p, p]); the CLS token and position table are replicated down each mesh column
([.., h_j]); every encoder linear is a Linear2D (heads over mesh columns, the HF attention
unchanged on its local heads); every LayerNorm a LayerNorm2D; the classifier a Linear2D
whose output classes are split over mesh columns, scored by the vocab-parallel
cross-entropy on the CLS token.

``forward(pixel_values, labels=None)`` takes the batch of the mesh's data-parallel group and
returns an ``ImageClassifierOutput`` with the mean loss over it (with labels) and the full
logits [B, classes] (gathered, for accuracy).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import ImageClassifierOutput

from colossal_hetero.tp2d.gpt2 import GPT2Shares
from colossal_hetero.tp2d.hf_gpt2 import adopt, split_rows
from colossal_hetero.tp2d.layers import (
    LayerNorm2D,
    Linear2D,
    column_shared,
    dense_vector_block,
    gather_batch_2d,
    split_batch_2d,
    vocab_cross_entropy_2d,
)
from colossal_hetero.tp2d.layout import even_sizes, head_widths
from colossal_hetero.tp2d.mesh import Mesh2D
from colossal_hetero.tp2d.state import BlockSpec, install_full_state_dict, mark


def check_vit(config: Any) -> None:
    """ValueError naming the field when a ViT config does not fit 2D."""
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        if getattr(config, name, 0.0):
            raise ValueError(f"model.hf.{name}: 2D ViT needs dropout 0")
    if getattr(config, "num_labels", 2) < 2:
        raise ValueError("model.hf.num_labels: 2D ViT classifies (at least 2 labels)")


def _linear(mesh: Mesh2D, linear: nn.Linear, rows: tuple, cols: tuple) -> Linear2D:
    layer = Linear2D(mesh, rows, cols, dtype=linear.weight.dtype)
    layer.load_dense(linear.weight.detach().t(), linear.bias.detach())
    specs = {
        "weight": BlockSpec(mesh, rows, cols, transpose=True),
        "bias": BlockSpec(mesh, None, cols),
    }
    return adopt(layer, linear, specs)


def _norm(mesh: Mesh2D, ln: nn.LayerNorm, widths: tuple) -> LayerNorm2D:
    norm = LayerNorm2D(mesh, widths, eps=ln.eps, dtype=ln.weight.dtype)
    norm.load_dense(ln.weight.detach(), ln.bias.detach())
    spec = BlockSpec(mesh, None, widths)
    return adopt(norm, ln, {"weight": spec, "bias": spec})


def _column_vector(mesh: Mesh2D, param: nn.Parameter, widths: tuple) -> None:
    """A [.., H] parameter becomes its column block [.., h_j], replicated down the column."""
    param.data = dense_vector_block(param.detach(), widths, mesh.j)
    mark(param, BlockSpec(mesh, None, widths))


def _convert_layer(layer: Any, mesh: Mesh2D, widths: tuple, heads: int, ffn: tuple) -> None:
    layer.layernorm_before = _norm(mesh, layer.layernorm_before, widths)
    layer.layernorm_after = _norm(mesh, layer.layernorm_after, widths)
    attn = layer.attention.attention
    for name in ("query", "key", "value"):
        setattr(attn, name, _linear(mesh, getattr(attn, name), widths, widths))
    attn.num_attention_heads, attn.all_head_size = heads, widths[mesh.j]
    out = layer.attention.output
    out.dense = _linear(mesh, out.dense, widths, widths)
    layer.intermediate.dense = _linear(mesh, layer.intermediate.dense, widths, ffn)
    layer.output.dense = _linear(mesh, layer.output.dense, ffn, widths)


class ViTForImageClassification2D(nn.Module):
    """ViT classifier on a q x q mesh with HF names (see the module docstring).

    ``shares.vocab_sizes``: the classes of each mesh column.
    """

    def __init__(self, hf_model: Any, mesh: Mesh2D, shares: GPT2Shares) -> None:
        super().__init__()
        config = hf_model.config
        check_vit(config)
        self.config, self.mesh, self.shares = config, mesh, shares
        head_dim = config.hidden_size // config.num_attention_heads
        self.widths = widths = head_widths(shares.head_counts, head_dim)
        vit = hf_model.vit
        emb = vit.embeddings
        conv = emb.patch_embeddings.projection
        self.patch = conv.kernel_size[0]
        self.patch_in = even_sizes(conv.weight[0].numel(), mesh.q)
        projection = Linear2D(mesh, self.patch_in, widths, dtype=conv.weight.dtype)
        projection.load_dense(conv.weight.detach().reshape(conv.out_channels, -1).t(), conv.bias)
        full = tuple(conv.weight.shape)
        specs = {
            "weight": BlockSpec(mesh, self.patch_in, widths, transpose=True, full_shape=full),
            "bias": BlockSpec(mesh, None, widths),
        }
        emb.patch_embeddings.projection = adopt(projection, conv, specs)
        _column_vector(mesh, emb.cls_token, widths)
        _column_vector(mesh, emb.position_embeddings, widths)
        for layer in vit.encoder.layer:
            _convert_layer(layer, mesh, widths, shares.head_counts[mesh.j], shares.ffn_sizes)
        vit.layernorm = _norm(mesh, vit.layernorm, widths)
        self.vit = vit
        self.classifier = _linear(mesh, hf_model.classifier, widths, tuple(shares.vocab_sizes))
        install_full_state_dict(self)

    def forward(
        self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any
    ) -> ImageClassifierOutput:
        if any(v is not None for v in kwargs.values()):
            raise ValueError(f"2D ViT does not take {sorted(kwargs)}")
        sizes = split_rows(self.shares, self.mesh.q, pixel_values.shape[0])
        mesh, emb = self.mesh, self.vit.embeddings
        patches = F.unfold(pixel_values, self.patch, stride=self.patch).transpose(1, 2)
        hidden = emb.patch_embeddings.projection(
            split_batch_2d(patches, mesh, sizes, self.patch_in)
        )
        cls = column_shared(emb.cls_token, mesh).expand(hidden.shape[0], -1, -1)
        hidden = torch.cat([cls, hidden], 1) + column_shared(emb.position_embeddings, mesh)
        for layer in self.vit.encoder.layer:
            hidden = layer(hidden)[0]
        logits = self.classifier(self.vit.layernorm(hidden)[:, 0])  # [b_i, classes_j]
        classes = self.shares.vocab_sizes
        full = gather_batch_2d(logits.detach(), mesh, sizes, classes)
        if labels is None:
            return ImageClassifierOutput(logits=full)
        local = split_batch_2d(labels, mesh, sizes, None)
        loss = vocab_cross_entropy_2d(logits, local, mesh, classes)
        return ImageClassifierOutput(loss=loss, logits=full)
