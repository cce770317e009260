"""Several stragglers migrating to the same helpers in one layer, losslessly.

:class:`MultiMigration` is a layer ``local_op`` holding one :class:`Migration` per migrating
straggler (each with the same helpers). A straggler runs its own migration's straggler side
(migrate.py); a helper runs :class:`_Helpers`, which serves the stragglers one after the other
in the order given, the same order on every rank, so every send meets its receive:

    straggler r:  send W_r[:, M_rh] (and x_r[..., M_rh]) to each helper, compute, receive
    helper h:     for r in order: receive W_r[:, M_rh] (and x); send r its partial output
                  (column) or add it to its own partial (row)
and in backward the same order (column: receive dy_r, add dy_r W_r[:, M_rh] to its dx, send
dW_r[:, M_rh]; row: send dx_r[..., M_rh] and dW_r[:, M_rh]). With one straggler this is the
single-straggler op of migrate.py, message for message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from colossal_hetero.balance.ops.migrate import Migration, _flat, _is_column
from colossal_hetero.layers.linear import ResizableParallelModule


class MultiMigration:
    """``local_op`` of several migrating stragglers (``ops``: one :class:`Migration` each,
    distinct stragglers, none of them a helper of another)."""

    def __init__(self, ops: Sequence[Migration]) -> None:
        stragglers = [op.straggler for op in ops]
        helpers = {h for op in ops for h in op.helpers}
        if len(set(stragglers)) != len(stragglers) or helpers & set(stragglers):
            raise ValueError(f"stragglers {stragglers} must be distinct and no helper's")
        self.ops = tuple(ops)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent, over every migration."""
        return sum(op.bytes_sent for op in self.ops)

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer: ResizableParallelModule,
    ) -> torch.Tensor:
        for op in self.ops:
            if layer.rank == op.straggler:
                return op(x, weight, bias, layer)
        served = [
            (op, cols.to(x.device))
            for op in self.ops
            for helper, cols in op.active_helpers()
            if helper == layer.rank
        ]
        if not served:
            return F.linear(x, weight, bias)
        return _Helpers.apply(x, weight, bias, tuple(served), layer)


class _Helpers(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, weight, bias, served, layer):  # type: ignore[override]
        column = _is_column(layer)
        y = F.linear(x, weight, bias)
        saved = []
        for op, cols in served:
            peer = op.straggler
            rows = layer.num_parts * layer.widths[peer] if column else weight.shape[0]
            w_m = op.recv((rows, cols.numel()), weight, peer, layer)
            if column:
                x_m = x.index_select(-1, cols)
                op.send(F.linear(x_m, w_m), peer, layer)
            else:
                x_m = op.recv((*x.shape[:-1], cols.numel()), x, peer, layer)
                y = y + F.linear(x_m, w_m)
            saved.append((w_m, x_m))
        ctx.save_for_backward(x, weight)
        ctx.meta = (served, saved, layer, bias is not None)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        served, saved, layer, has_bias = ctx.meta
        column, dy = _is_column(layer), dy.contiguous()
        dx, dw = dy @ weight, _flat(dy).t() @ _flat(x)
        db = _flat(dy).sum(0) if has_bias else None
        for (op, cols), (w_m, x_m) in zip(served, saved, strict=True):
            peer = op.straggler
            if column:
                dy_r = op.recv((*dy.shape[:-1], w_m.shape[0]), dy, peer, layer)
                dx.index_add_(dx.dim() - 1, cols, dy_r @ w_m)
            else:
                dy_r = dy
                op.send(dy_r @ w_m, peer, layer)
            op.send(_flat(dy_r).t() @ _flat(x_m), peer, layer)
        return dx, dw, db, None, None
