"""Lightweight migration: helper ranks compute a straggler's lowest-priority columns, losslessly.

Attached as a layer's ``local_op`` (layers/linear.py), identical on every rank of the group.
Straggler r holds W_r [N_r, K_r] (a view for Conv1D); its columns split into C (computed by r),
M_h (computed by helper h) and D (dropped: ZERO-resizing on top, imputed as in resize.py).
Only point-to-point send/recv on the layer's group (gloo and NCCL both have them); parameters
and optimizer state never move: r receives the gradients of its migrated columns and steps them.

Column-parallel (x [*, K] replicated, y_r [*, N_r] local to r):
    forward   r -> h: W_r[:, M_h]  (once per forward, kept for backward)
              h -> r: x[..., M_h] @ W_r[:, M_h]^T, added to r's output
    backward  r -> h: dy_r;  h adds dy_r @ W_r[:, M_h] into its own dx (the layer's existing
              dx all-reduce then sums it: no extra collective);  h -> r: dW_r[:, M_h]
Row-parallel (x_r [*, K_r] differs per rank, partial outputs all-reduced by the layer):
    forward   r -> h: W_r[:, M_h] and x_r[..., M_h];  h adds x_r[..., M_h] @ W_r[:, M_h]^T to its
              own partial output (merged into the layer's all-reduce)
    backward  dy is replicated;  h -> r: dx_r[..., M_h] = dy @ W_r[:, M_h]  and  dW_r[:, M_h]

Bytes sent per forward+backward, B = prod(x.shape[:-1]), m_h = |M_h|, e = element size:
    column: sum_h (2 * N_r * m_h + 2 * B * N_r) * e;   row: sum_h 2 * (N_r + B) * m_h * e
``Migration.bytes_sent`` accumulates what this rank sent.

As with every TP layer, each rank's output must reach the loss: a helper's backward waits
for the straggler's ``dy_r`` (column-parallel), so a straggler that skipped its backward
would leave the helper waiting.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from colossal_hetero.balance.ops.resize import (
    check_columns,
    complement,
    reduction_width,
)
from colossal_hetero.balance.ops.selection import MigrationSplit
from colossal_hetero.layers.linear import (
    ResizableConv1DCol,
    ResizableLinearCol,
    ResizableParallelModule,
)


def _is_column(layer: ResizableParallelModule) -> bool:
    return isinstance(layer, (ResizableLinearCol, ResizableConv1DCol))


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[*, K] -> [prod(*), K]; also for K = 0 (a straggler whose columns all migrated)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


class Migration:
    """``local_op`` moving ``split.migrated[i]`` of rank ``straggler`` to rank ``helpers[i]``.

    Ranks are ranks of the layer's group. ``split.dropped`` columns are ZERO-resized (imputed
    with ``impute_value``). ``bytes_sent`` counts this rank's sent bytes (see module docstring).
    """

    def __init__(
        self,
        straggler: int,
        helpers: Sequence[int],
        split: MigrationSplit,
        *,
        impute_value: float = 0.0,
    ) -> None:
        self.straggler, self.helpers, self.split = straggler, tuple(helpers), split
        self.impute_value = impute_value
        self.bytes_sent = 0

    def send(self, tensor: torch.Tensor, peer: int, layer: ResizableParallelModule) -> None:
        """Send to group rank ``peer`` and count the bytes."""
        tensor = tensor.contiguous()
        dist.send(tensor, dst=dist.get_global_rank(layer.group, peer), group=layer.group)
        self.bytes_sent += tensor.numel() * tensor.element_size()

    @staticmethod
    def recv(shape: Sequence[int], like: torch.Tensor, peer: int, layer: Any) -> torch.Tensor:
        """Receive a tensor of ``shape`` (dtype and device of ``like``) from group rank ``peer``."""
        out = torch.empty(*shape, dtype=like.dtype, device=like.device)
        dist.recv(out, src=dist.get_global_rank(layer.group, peer), group=layer.group)
        return out

    def active_helpers(self) -> list[tuple[int, torch.Tensor]]:
        """(helper, its columns) for helpers with a non-empty slice (empty ones skip the sends)."""
        return [(h, m) for h, m in zip(self.helpers, self.split.migrated, strict=True) if m.numel()]

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer: ResizableParallelModule,
    ) -> torch.Tensor:
        if layer.rank == self.straggler:
            return _Straggler.apply(x, weight, bias, self, layer)
        for helper, cols in self.active_helpers():
            if layer.rank == helper:
                return _Helper.apply(x, weight, bias, self, layer, cols.to(x.device))
        return F.linear(x, weight, bias)


class _Straggler(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, weight, bias, op, layer):  # type: ignore[override]
        column, compute = _is_column(layer), op.split.compute.to(x.device)
        for helper, cols in op.active_helpers():
            cols = cols.to(x.device)
            op.send(weight.index_select(1, cols), helper, layer)
            if not column:
                op.send(x.index_select(-1, cols), helper, layer)
        x_c, w_c = x.index_select(-1, compute), weight.index_select(1, compute)
        y = F.linear(x_c, w_c, bias)
        if column:
            for helper, _ in op.active_helpers():
                y = y + op.recv(y.shape, y, helper, layer)
        ctx.save_for_backward(x_c, w_c, compute)
        ctx.meta = (op, layer, x.shape, weight.shape, bias is not None)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        x_c, w_c, compute = ctx.saved_tensors
        op, layer, x_shape, w_shape, has_bias = ctx.meta
        column, dy = _is_column(layer), dy.contiguous()
        if column:
            for helper, _ in op.active_helpers():
                op.send(dy, helper, layer)
        dx = dy.new_full(x_shape, op.impute_value)
        dw = dy.new_full(w_shape, op.impute_value)
        last = dx.dim() - 1
        dx.index_copy_(last, compute, dy @ w_c)
        dw.index_copy_(1, compute, _flat(dy).t() @ _flat(x_c))
        for helper, cols in op.active_helpers():
            cols = cols.to(dy.device)
            if column:  # the helper's dx share reaches the sum through the layer's all-reduce
                dx.index_fill_(last, cols, 0)
            else:
                dx.index_copy_(
                    last, cols, op.recv((*x_shape[:-1], cols.numel()), dy, helper, layer)
                )
            dw.index_copy_(1, cols, op.recv((w_shape[0], cols.numel()), dy, helper, layer))
        db = _flat(dy).sum(0) if has_bias else None
        return dx, dw, db, None, None


class _Helper(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, weight, bias, op, layer, cols):  # type: ignore[override]
        column, peer = _is_column(layer), op.straggler
        rows = layer.num_parts * layer.widths[peer] if column else weight.shape[0]
        w_m = op.recv((rows, cols.numel()), weight, peer, layer)
        y = F.linear(x, weight, bias)
        if column:
            x_m = x.index_select(-1, cols)
            op.send(F.linear(x_m, w_m), peer, layer)
        else:
            x_m = op.recv((*x.shape[:-1], cols.numel()), x, peer, layer)
            y = y + F.linear(x_m, w_m)
        ctx.save_for_backward(x, weight, w_m, x_m, cols)
        ctx.meta = (op, layer, bias is not None)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        x, weight, w_m, x_m, cols = ctx.saved_tensors
        op, layer, has_bias = ctx.meta
        column, peer, dy = _is_column(layer), op.straggler, dy.contiguous()
        dx, dw = dy @ weight, _flat(dy).t() @ _flat(x)
        db = _flat(dy).sum(0) if has_bias else None
        if column:
            dy_r = op.recv((*dy.shape[:-1], w_m.shape[0]), dy, peer, layer)
            dx.index_add_(dx.dim() - 1, cols, dy_r @ w_m)
        else:
            dy_r = dy
            op.send(dy_r @ w_m, peer, layer)
        op.send(_flat(dy_r).t() @ _flat(x_m), peer, layer)
        return dx, dw, db, None, None, None


def attach_migration(
    layer: ResizableParallelModule,
    straggler: int,
    helpers: Sequence[int],
    split: MigrationSplit,
    *,
    impute_value: float = 0.0,
) -> Migration:
    """Check the plan (every rank, before any collective) and set it as ``layer.local_op``.

    ``split`` covers range(K) of the straggler (see ``reduction_width``) disjointly, with one
    migrated slice per helper; helpers are distinct group ranks other than the straggler.
    """
    ranks = len(layer.widths)
    if not 0 <= straggler < ranks:
        raise ValueError(f"straggler must be a rank of the layer's group, got {straggler}")
    if len(set(helpers)) != len(helpers) or any(
        not 0 <= h < ranks or h == straggler for h in helpers
    ):
        raise ValueError(f"helpers must be distinct group ranks other than {straggler}: {helpers}")
    if len(split.migrated) != len(helpers):
        raise ValueError(
            f"split has {len(split.migrated)} migrated slices for {len(helpers)} helpers"
        )
    width = reduction_width(layer, straggler)
    parts = [split.compute, *split.migrated, split.dropped]
    for name, part in zip(["compute", *["migrated"] * len(helpers), "dropped"], parts, strict=True):
        check_columns(part.cpu(), width, f"split.{name}")
    union = torch.cat([p.cpu() for p in parts]).sort().values
    if not torch.equal(union, torch.arange(width)):
        raise ValueError(f"split must cover range({width}) exactly once")
    assert complement(union, width).numel() == 0
    op = Migration(straggler, helpers, split, impute_value=impute_value)
    layer.local_op = op
    return op
