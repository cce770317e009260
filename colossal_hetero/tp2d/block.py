"""A GPT-style pre-norm transformer block in 2D: attention heads split over mesh columns.

Rank (i, j) holds x [b_i, S, h_j] with h_j = a_j * d: mesh column j owns a_j whole heads of
size d (``head_counts``), so attention (scores, softmax, weighted sum) is local to the rank:
full sequences of its batch share, its heads. Everything else is the 2D layers:

    x + proj(attention(qkv(ln_1(x))))  then  x + fc2(gelu(fc1(ln_2(x))))

``qkv`` is one Linear2D [H, 3H] whose column block j is [Q_j | K_j | V_j] (Q, K, V each cut
by the head widths), as GPT-2's fused c_attn is cut per head group; the MLP's inner width
per column is ``ffn_sizes`` (4 h_j for GPT-2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from colossal_hetero.tp2d.layers import LayerNorm2D, Linear2D
from colossal_hetero.tp2d.layout import check_sizes, head_widths
from colossal_hetero.tp2d.mesh import Mesh2D

DENSE_KEYS = (
    "ln_1.weight ln_1.bias qkv.weight qkv.bias proj.weight proj.bias "
    "ln_2.weight ln_2.bias fc1.weight fc1.bias fc2.weight fc2.bias"
).split()
"""Dense parameters of one block: linear weights stored [in, out] (x @ W, GPT-2 Conv1D).
A Block2D parameter's name is its dense key with ``attn.`` in front of ``qkv`` and ``proj``."""


class Attention2D(nn.Module):
    """Causal self-attention: x [b_i, S, h_j] -> [b_i, S, h_j]; heads a_j local to column j."""

    def __init__(self, mesh: Mesh2D, head_counts: Sequence[int], head_dim: int, **kw: Any) -> None:
        super().__init__()
        self.head_counts = check_sizes(head_counts, mesh.q, name="head_counts")
        self.head_dim = head_dim
        widths = head_widths(self.head_counts, head_dim)
        self.qkv = Linear2D(mesh, widths, [3 * w for w in widths], **kw)
        self.proj = Linear2D(mesh, widths, widths, **kw)
        self.local_heads = self.head_counts[mesh.j]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch, seq, self.local_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class Block2D(nn.Module):
    """Pre-norm block: x [b_i, S, h_j] -> [b_i, S, h_j] (see the module docstring)."""

    def __init__(
        self,
        mesh: Mesh2D,
        head_counts: Sequence[int],
        head_dim: int,
        ffn_sizes: Sequence[int],
        *,
        eps: float = 1e-5,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        widths = head_widths(head_counts, head_dim)
        self.ln_1 = LayerNorm2D(mesh, widths, eps=eps, **kw)
        self.attn = Attention2D(mesh, head_counts, head_dim, **kw)
        self.ln_2 = LayerNorm2D(mesh, widths, eps=eps, **kw)
        self.fc1 = Linear2D(mesh, widths, ffn_sizes, **kw)
        self.fc2 = Linear2D(mesh, ffn_sizes, widths, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))

    def load_dense(self, params: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's blocks of a dense block's parameters (keys: ``DENSE_KEYS``)."""
        missing = [key for key in DENSE_KEYS if key not in params]
        if missing:
            raise ValueError(f"dense block parameters miss {missing}")
        self.ln_1.load_dense(params["ln_1.weight"], params["ln_1.bias"])
        self.ln_2.load_dense(params["ln_2.weight"], params["ln_2.bias"])
        self.attn.qkv.load_dense(params["qkv.weight"], params["qkv.bias"], parts=3)
        self.attn.proj.load_dense(params["proj.weight"], params["proj.bias"])
        self.fc1.load_dense(params["fc1.weight"], params["fc1.bias"])
        self.fc2.load_dense(params["fc2.weight"], params["fc2.bias"])
