"""The plain (no balancing op) local products of the resizable TP layers, with their collectives
fused in, so that communication overlaps compute where the math allows.

Column-parallel (``column_linear``): forward ``y_local = x @ W_local^T + b_local`` with no
communication; backward starts the all-reduce of ``dx = dy_local @ W_local`` over ``group``
asynchronously and computes ``dW`` and ``db`` while it runs. Separately (``copy_to_group``
then ``F.linear``) the all-reduce ran after autograd had also finished ``dW``, and every rank,
the slowest included, waited for its whole latency: on 4 gloo CPU ranks that exposed
latency was most of what made our even TP slower than Colossal-AI's (which overlaps it too).

Row-parallel (``row_linear``): forward all-reduces ``x_local @ W_local^T`` in place (no copy
of the partial sums); backward has no communication.

Both compute exactly what the unfused form computes (the same products, the same sum).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` [*, D] as [prod(*), D] (D may be 0)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _weight_grad(grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dW = dy^T x`` over every leading dimension: [N, K] from dy [*, N] and x [*, K]."""
    return _rows(grad_y).t().matmul(_rows(x))


class _ColumnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, weight, bias, group):  # type: ignore[override]
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = work = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_y.matmul(weight)  # a fresh tensor: reduced in place
            work = dist.all_reduce(grad_x, group=ctx.group, async_op=True)
        grad_w = _weight_grad(grad_y, x) if ctx.needs_input_grad[1] else None
        grad_b = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = _rows(grad_y).sum(0)
        if work is not None:
            work.wait()
        return grad_x, grad_w, grad_b, None


class _RowLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, weight, group):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        y = F.linear(x, weight)  # a fresh tensor: reduced in place
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x = grad_y.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = _weight_grad(grad_y, x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def column_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, group: ProcessGroup
) -> torch.Tensor:
    """``x [*, K] @ weight [N_r, K]^T + bias [N_r]`` for a replicated ``x``; its gradient is
    summed over ``group`` (the all-reduce overlaps the weight gradient)."""
    if group is None:
        raise ValueError("group is required (None would silently mean the world group)")
    return _ColumnLinear.apply(x, weight, bias, group)


def row_linear(x: torch.Tensor, weight: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """Sum over ``group`` of ``x_local [*, K_r] @ weight [N, K_r]^T`` (no bias); backward has
    no communication."""
    if group is None:
        raise ValueError("group is required (None would silently mean the world group)")
    return _RowLinear.apply(x, weight, group)
