"""2D tensor-parallel layers over a q x q mesh, with uneven (resizable) block sizes.

Shape letters (rank at mesh (i, j)): ``batch_sizes`` b_0..b_{q-1} (a batch share per mesh
row), ``hidden_sizes`` h_0..h_{q-1} (a hidden width per mesh column), S the sequence, V the
vocabulary with ``vocab_sizes`` v_0..v_{q-1}.

    activation     x [b_i, *, h_j]          (batch by mesh row, hidden by mesh column)
    Linear2D       weight [in_i, out_j]     y = x W + b (x @ W, as GPT-2's Conv1D stores it)
    vectors        bias, gamma, beta [n_j]  replicated down mesh column j
    Embedding2D    weight [v_i, h_j]        vocab by mesh row, hidden by mesh column
    LM head        logits [b_i * S, v_j]    = x E^T (summa_abt), vocab by mesh column

Communication: the linear is summa_ab (q broadcasts on each of the row and column groups;
backward 2 more kernels). Norms all-reduce per-token statistics over the row group (2 in the
forward, 1 of two sums in the backward for LayerNorm; 1 + 1 for RMSNorm) and keep only the
normalised input and rstd for the backward. A column-replicated vector has
no forward communication; its gradient is all-reduced over the column group in the backward
(the q batch shares' contributions), so it stays identical down the column under any
optimizer. The embedding reduce-scatters its partial lookups along the batch over the column
group (q reduces); the loss all-reduces max, target logit and sum of exps over the row group
and the token sum and count over the column group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from colossal_hetero.comm import all_reduce, copy_to_group
from colossal_hetero.tp2d import comm2d
from colossal_hetero.tp2d.layout import check_sizes, offsets
from colossal_hetero.tp2d.mesh import Mesh2D
from colossal_hetero.tp2d.summa import summa_ab, summa_abt

if TYPE_CHECKING:
    from colossal_hetero.tp2d.resize import Resize2D


def dense_block(
    x: torch.Tensor, rows: Sequence[int], cols: Sequence[int], i: int, j: int, parts: int = 1
) -> torch.Tensor:
    """Block (i, j) of a dense matrix x [R, P * sum(cols)] cut by ``rows`` and ``cols``.

    With ``parts`` > 1 the columns are P fused parts (e.g. [Q | K | V]), each cut by ``cols``;
    the block concatenates part p's column block j for p = 0..P-1.
    """
    r0 = offsets(rows)[i]
    x = x[r0 : r0 + rows[i]]
    return dense_vector_block(x, cols, j, parts)


def dense_vector_block(
    x: torch.Tensor, cols: Sequence[int], j: int, parts: int = 1
) -> torch.Tensor:
    """Block j of the last dim of x [..., P * sum(cols)] (P fused parts, each cut by ``cols``)."""
    width, c0 = sum(cols), offsets(cols)[j]
    if x.shape[-1] != parts * width:
        raise ValueError(f"last dim {x.shape[-1]} is not {parts} parts of {width}")
    pieces = [x[..., p * width + c0 : p * width + c0 + cols[j]] for p in range(parts)]
    return torch.cat(pieces, -1).contiguous()


def column_shared(param: torch.Tensor, mesh: Mesh2D) -> torch.Tensor:
    """A vector replicated down mesh column j: gradient summed over the column group."""
    return param if mesh.q == 1 else copy_to_group(param, group=mesh.col_group)


class Linear2D(nn.Module):
    """y [b_i, *, out_j] = x [b_i, *, in_j] W + bias, W [in, out] cut into [in_i, out_j] blocks.

    ``in_sizes`` cuts the input features (over mesh columns for x, mesh rows for W);
    ``out_sizes`` the output features over mesh columns. Forward: one summa_ab; backward:
    summa_abt (dx) and summa_atb (dW), plus the bias's column all-reduce. ``resize``: a
    ZERO-resizing of one mesh position's GEMMs (tp2d/resize.py; training with grad only).
    """

    def __init__(
        self,
        mesh: Mesh2D,
        in_sizes: Sequence[int],
        out_sizes: Sequence[int],
        *,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.mesh = mesh
        self.in_sizes = check_sizes(in_sizes, mesh.q, name="Linear2D in_sizes")
        self.out_sizes = check_sizes(out_sizes, mesh.q, name="Linear2D out_sizes")
        shape = (self.in_sizes[mesh.i], self.out_sizes[mesh.j])
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(max(sum(self.in_sizes), 1)))
        self.bias = (
            nn.Parameter(torch.zeros(shape[1], dtype=dtype, device=device)) if bias else None
        )
        self.resize: Resize2D | None = None

    @torch.no_grad()
    def load_dense(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, parts: int = 1
    ) -> None:
        """Copy this rank's block of a dense weight [in, P * out] (and bias [P * out])."""
        i, j = self.mesh.i, self.mesh.j
        self.weight.copy_(dense_block(weight, self.in_sizes, self._part_sizes(parts), i, j, parts))
        if self.bias is not None and bias is not None:
            self.bias.copy_(dense_vector_block(bias, self._part_sizes(parts), j, parts))

    def _part_sizes(self, parts: int) -> tuple[int, ...]:
        if any(size % parts for size in self.out_sizes):
            raise ValueError(f"out_sizes {list(self.out_sizes)} are not {parts} fused parts")
        return tuple(size // parts for size in self.out_sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, kept, fill = x.shape[:-1], None, 0.0
        if self.resize is not None and self.training and torch.is_grad_enabled():
            kept, fill = self.resize.steps, self.resize.impute_value
        x2d = x.reshape(-1, x.shape[-1])
        y = summa_ab(x2d, self.weight, self.mesh, self.in_sizes, kept=kept, fill=fill)
        y = y.reshape(*lead, y.shape[-1])
        if self.bias is not None:
            y = y + column_shared(self.bias, self.mesh)
        return y


class _Norm2D(nn.Module):
    """Shared parts of the 2D norms: a gain (and shift) [h_j] replicated down column j."""

    def __init__(
        self,
        mesh: Mesh2D,
        hidden_sizes: Sequence[int],
        *,
        eps: float,
        shift: bool,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.mesh, self.eps = mesh, eps
        self.hidden_sizes = check_sizes(hidden_sizes, mesh.q, name="norm hidden_sizes")
        width = self.hidden_sizes[mesh.j]
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(width, dtype=dtype, device=device)) if shift else None

    @torch.no_grad()
    def load_dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this column's block of dense [H] gain (and shift)."""
        self.weight.copy_(dense_vector_block(weight, self.hidden_sizes, self.mesh.j))
        if self.bias is not None and bias is not None:
            self.bias.copy_(dense_vector_block(bias, self.hidden_sizes, self.mesh.j))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centre = self.bias is not None
        normed = _Normalize.apply(x, self.mesh, sum(self.hidden_sizes), self.eps, centre)
        y = normed * column_shared(self.weight, self.mesh)
        return y + column_shared(self.bias, self.mesh) if self.bias is not None else y


def _row_sum(x: torch.Tensor, mesh: Mesh2D) -> torch.Tensor:
    """Sum over the last dim of x [..., h_j] and over the row group: [..., 1] (no autograd)."""
    total = x.sum(-1, keepdim=True)
    if mesh.q > 1:
        dist.all_reduce(total, group=mesh.row_group)
    return total


class _Normalize(torch.autograd.Function):
    """x [..., h_j] -> x_hat = (x - mean) * rstd (``centre``) or x * rstd, statistics over the
    full hidden dim ``width`` (row group). Saves x_hat and rstd only, as a fused LayerNorm
    kernel does; the backward recomputes the rest: dx = rstd (g - mean(g) - x_hat mean(g
    x_hat)) (without the mean(g) term when not centred), one row all-reduce of both sums."""

    @staticmethod
    def forward(ctx: Any, x, mesh, width, eps, centre):  # type: ignore[override]
        if centre:
            x = x - _row_sum(x, mesh) / width
        rstd = torch.rsqrt(_row_sum(x * x, mesh) / width + eps)
        normed = x * rstd
        ctx.save_for_backward(normed, rstd)
        ctx.mesh, ctx.width, ctx.centre = mesh, width, centre
        return normed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        normed, rstd = ctx.saved_tensors
        sums = [(grad * normed).sum(-1, keepdim=True)]
        if ctx.centre:
            sums.append(grad.sum(-1, keepdim=True))
        stats = torch.cat(sums, -1)
        if ctx.mesh.q > 1:
            dist.all_reduce(stats, group=ctx.mesh.row_group)
        stats = stats / ctx.width
        dx = grad - normed * stats[..., :1]
        if ctx.centre:
            dx = dx - stats[..., 1:]
        return dx * rstd, None, None, None, None


class LayerNorm2D(_Norm2D):
    """LayerNorm over a hidden dim split by mesh columns: x [b_i, *, h_j] -> same shape.

    Two-pass statistics (mean, then the centred second moment), each one all-reduce of
    [b_i, *, 1] over the row group; the backward one all-reduce of [b_i, *, 2]. Keeps the
    normalised input and the per-token rstd for the backward (as a fused kernel does).
    """

    def __init__(self, mesh: Mesh2D, hidden_sizes: Sequence[int], *, eps: float = 1e-5, **kw: Any):
        super().__init__(mesh, hidden_sizes, eps=eps, shift=True, **kw)


class RMSNorm2D(_Norm2D):
    """RMSNorm (Llama) over a hidden dim split by mesh columns: one row all-reduce each way."""

    def __init__(self, mesh: Mesh2D, hidden_sizes: Sequence[int], *, eps: float = 1e-6, **kw: Any):
        super().__init__(mesh, hidden_sizes, eps=eps, shift=False, **kw)


class Embedding2D(nn.Module):
    """Vocab-parallel embedding: weight [v_i, h_j]; ids [B, S] (the full batch) -> [b_i, S, h_j].

    Each rank looks up the ids in its vocab range (others give zeros): a partial [B, S, h_j]
    whose sum down the column is the full lookup; q reduces over the column group sum it and
    leave batch share t on (t, j) at once. Backward: q column broadcasts of the grad blocks.
    The weight doubles as the LM head's (tied) weight, see ``LMHead2D``.
    """

    def __init__(
        self,
        mesh: Mesh2D,
        vocab_sizes: Sequence[int],
        hidden_sizes: Sequence[int],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.mesh = mesh
        self.vocab_sizes = check_sizes(vocab_sizes, mesh.q, name="Embedding2D vocab_sizes")
        self.hidden_sizes = check_sizes(hidden_sizes, mesh.q, name="Embedding2D hidden_sizes")
        shape = (self.vocab_sizes[mesh.i], self.hidden_sizes[mesh.j])
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=0.02)

    @torch.no_grad()
    def load_dense(self, weight: torch.Tensor) -> None:
        """Copy this rank's block of a dense table [V, H]."""
        self.weight.copy_(
            dense_block(weight, self.vocab_sizes, self.hidden_sizes, self.mesh.i, self.mesh.j)
        )

    def forward(self, ids: torch.Tensor, batch_sizes: Sequence[int]) -> torch.Tensor:
        start = offsets(self.vocab_sizes)[self.mesh.i]
        local = ids - start
        inside = (local >= 0) & (local < self.vocab_sizes[self.mesh.i])
        if self.vocab_sizes[self.mesh.i] == 0:
            partial = self.weight.new_zeros((*ids.shape, self.weight.shape[1]))
        else:
            looked = F.embedding(local.clamp(0, self.vocab_sizes[self.mesh.i] - 1), self.weight)
            partial = looked * inside.unsqueeze(-1).to(looked.dtype)
        return comm2d.reduce_scatter_along(partial, self.mesh, "col", 0, batch_sizes)


class LMHead2D(nn.Module):
    """logits [b_i * S, v_j] = x [b_i, S, h_j] E^T with E [V, H] cut [v_i, h_j] (summa_abt).

    ``weight``: the tied embedding's weight, or None for an own one.
    """

    def __init__(
        self,
        mesh: Mesh2D,
        vocab_sizes: Sequence[int],
        hidden_sizes: Sequence[int],
        weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.mesh = mesh
        self.vocab_sizes = check_sizes(vocab_sizes, mesh.q, name="LMHead2D vocab_sizes")
        self.hidden_sizes = check_sizes(hidden_sizes, mesh.q, name="LMHead2D hidden_sizes")
        shape = (self.vocab_sizes[mesh.i], self.hidden_sizes[mesh.j])
        if weight is None:
            weight = nn.Parameter(torch.empty(shape))
            nn.init.normal_(weight, std=0.02)
            self.weight = weight
        else:
            if tuple(weight.shape) != shape:
                raise ValueError(f"tied weight {tuple(weight.shape)} is not the block {shape}")
            self._tied = [weight]  # a list: not registered twice as a parameter

    def head_weight(self) -> torch.Tensor:
        return self._tied[0] if hasattr(self, "_tied") else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return summa_abt(
            x.reshape(-1, x.shape[-1]), self.head_weight(), self.mesh, self.vocab_sizes
        )


class _VocabCrossEntropy(torch.autograd.Function):
    """Per-token loss [N_i] from logits [N_i, v_j] (vocab over the row group); see below."""

    @staticmethod
    def forward(ctx: Any, logits, targets, mesh, vocab_sizes, ignore_index):  # type: ignore[override]
        start, width = offsets(vocab_sizes)[mesh.j], vocab_sizes[mesh.j]
        top = logits.max(-1).values if width else logits.new_full(logits.shape[:1], -math.inf)
        if mesh.q > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=mesh.row_group)
        shifted = logits - top.unsqueeze(-1)
        local = targets - start
        inside = (local >= 0) & (local < width)
        if width:
            picked = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
        else:  # an empty vocab block holds no target
            picked = logits.new_zeros(logits.shape[:1])
        exps = shifted.exp()
        stats = torch.stack([picked * inside.to(picked.dtype), exps.sum(-1)])
        if mesh.q > 1:
            dist.all_reduce(stats, group=mesh.row_group)  # [target logit, sum of exps]
        valid = (targets != ignore_index).to(logits.dtype)
        ctx.save_for_backward(exps / stats[1].unsqueeze(-1), local, inside, valid)
        return (stats[1].log() - stats[0]) * valid

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        softmax, local, inside, valid = ctx.saved_tensors
        scale = (grad * valid).unsqueeze(-1)
        out = softmax * scale
        rows = inside.nonzero().squeeze(-1)
        out[rows, local[rows]] -= scale[rows, 0]
        return out, None, None, None, None


def vocab_cross_entropy_2d(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mesh: Mesh2D,
    vocab_sizes: Sequence[int],
    *,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy over every valid token of the global batch, the same on every rank.

    logits [N_i, v_j] (this rank's batch-share tokens, vocab block j); targets [N_i] (global
    vocab ids of the same tokens). Row group: all-reduce MAX of the row maxima, then one
    all-reduce of [target logit, sum of exps]. Column group: all-reduce of the loss sum and
    of the valid-token count. Backward: no communication (the mean's grad is replicated).
    """
    vocab_sizes = check_sizes(vocab_sizes, mesh.q, name="vocab_sizes")
    per_token = _VocabCrossEntropy.apply(logits, targets, mesh, vocab_sizes, ignore_index)
    count = (targets != ignore_index).sum().to(logits.dtype).reshape(1)
    total = per_token.sum().reshape(1)
    if mesh.q > 1:
        total = all_reduce(total, group=mesh.col_group)
        dist.all_reduce(count, group=mesh.col_group)
    return (total / count.clamp(min=1)).squeeze(0)


def split_batch_2d(
    x: torch.Tensor, mesh: Mesh2D, batch_sizes: Sequence[int], hidden_sizes: Sequence[int] | None
) -> torch.Tensor:
    """Full x [B, ..., H] (replicated on the mesh) -> block [b_i, ..., h_j].

    ``hidden_sizes`` None: split the batch only (e.g. token ids [B, S] -> [b_i, S]). No
    forward communication; backward gathers the gradient (row then column broadcasts).
    """
    if hidden_sizes is not None:
        x = comm2d.split_along(x, mesh, "row", -1, hidden_sizes)
    return comm2d.split_along(x, mesh, "col", 0, batch_sizes)


def gather_batch_2d(
    x: torch.Tensor, mesh: Mesh2D, batch_sizes: Sequence[int], hidden_sizes: Sequence[int] | None
) -> torch.Tensor:
    """Block [b_i, ..., h_j] -> full [B, ..., H] on every rank (column then row broadcasts).

    Backward: the own block of the gradient (for a consumer replicated over the mesh).
    """
    x = comm2d.gather_along(x, mesh, "col", 0, batch_sizes)
    if hidden_sizes is not None:
        x = comm2d.gather_along(x, mesh, "row", -1, hidden_sizes)
    return x


def gather_matrix(
    block: torch.Tensor, mesh: Mesh2D, rows: Sequence[int], cols: Sequence[int]
) -> torch.Tensor:
    """The dense [sum(rows), sum(cols)] matrix from every rank's block (no autograd).

    For full state dicts: the inverse of ``dense_block``. Column then row broadcasts.
    """
    with torch.no_grad():
        full_rows = comm2d.gather_blocks(block, mesh, "col", 0, rows)
        return comm2d.gather_blocks(full_rows, mesh, "row", 1, cols)
