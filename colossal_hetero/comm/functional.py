"""Differentiable collectives over uneven shards (Megatron's mappings, with per-rank widths).

Shape letters (R ranks in ``group``, this rank r):
    widths  w_0..w_{R-1} along ``dim``, summing to W; any may be 0.
    x_local [..., w_r, ...]    x_full [..., W, ...]

Conjugate pairs (forward / backward), every collective on ``group``:

=====================  =============================  ==========================================
function               forward                        backward
=====================  =============================  ==========================================
all_gather_uneven      gather shards -> x_full        own slice of the grad, or (reduce_grads)
                                                      reduce-scatter of the grads
reduce_scatter_uneven  sum over ranks, keep own slice gather the grad shards
split_uneven           keep own slice (no comm)       gather the grad shards
all_reduce             sum over ranks                 identity
copy_to_group          identity                       sum the grads over ranks
all_to_all_uneven      re-shard cat_dim -> split_dim  re-shard split_dim -> cat_dim
=====================  =============================  ==========================================

``group`` is a required keyword everywhere (None never means the world group). ``method``
picks "padded" (one even collective on padded shards) or "grouped" (per-shard broadcasts and
reduces, or all_to_all_single with splits): same values, different cost (see primitives).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal_hetero.comm import primitives as prim
from colossal_hetero.comm.primitives import Method


def own_slice(x_full: torch.Tensor, dim: int, widths: Sequence[int], rank: int) -> torch.Tensor:
    """x_full [..., W, ...] -> x_full[..., offset_r : offset_r + w_r, ...] (contiguous copy)."""
    start = prim.offsets(widths)[rank]
    return x_full.narrow(dim, start, widths[rank]).contiguous()


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, dim, widths, group, method, reduce_grads):  # type: ignore[override]
        ctx.args = (dim, widths, group, method, reduce_grads)
        return prim.gather(x, dim, widths, group=group, method=method)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        dim, widths, group, method, reduce_grads = ctx.args
        if reduce_grads:
            grad = prim.reduce_scatter(grad, dim, widths, group=group, method=method)
        else:
            grad = own_slice(grad, dim, widths, dist.get_rank(group))
        return grad, None, None, None, None, None


def all_gather_uneven(
    x_local: torch.Tensor,
    dim: int,
    widths: Sequence[int],
    *,
    group: ProcessGroup,
    method: Method = "padded",
    reduce_grads: bool = False,
) -> torch.Tensor:
    """x_local [..., w_r, ...] -> x_full [..., W, ...] on every rank of ``group``.

    Backward: with ``reduce_grads=False`` (the default, for a replicated consumer whose
    gradient is the same on every rank) each rank keeps its own slice of the gradient; with
    ``reduce_grads=True`` (consumers that differ per rank) the gradients are reduce-scattered.
    """
    widths = prim.check_widths(widths, group)
    prim.check_method(method)
    return _AllGather.apply(x_local, dim % x_local.dim(), widths, group, method, reduce_grads)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, dim, widths, group, method):  # type: ignore[override]
        ctx.args = (dim, widths, group, method)
        return prim.reduce_scatter(x, dim, widths, group=group, method=method)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        dim, widths, group, method = ctx.args
        grad = prim.gather(grad.contiguous(), dim, widths, group=group, method=method)
        return grad, None, None, None, None


def reduce_scatter_uneven(
    x_full: torch.Tensor,
    dim: int,
    widths: Sequence[int],
    *,
    group: ProcessGroup,
    method: Method = "padded",
) -> torch.Tensor:
    """x_full [..., W, ...] (a partial sum per rank) -> own slice [..., w_r, ...] of the sum.

    Backward: all-gather of the gradient shards over ``group``.
    """
    widths = prim.check_widths(widths, group)
    prim.check_method(method)
    return _ReduceScatter.apply(x_full, dim % x_full.dim(), widths, group, method)


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, dim, widths, group, method):  # type: ignore[override]
        ctx.args = (dim, widths, group, method)
        return own_slice(x, dim, widths, dist.get_rank(group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        dim, widths, group, method = ctx.args
        grad = prim.gather(grad.contiguous(), dim, widths, group=group, method=method)
        return grad, None, None, None, None


def split_uneven(
    x_full: torch.Tensor,
    dim: int,
    widths: Sequence[int],
    *,
    group: ProcessGroup,
    method: Method = "padded",
) -> torch.Tensor:
    """x_full [..., W, ...] (replicated) -> own slice [..., w_r, ...]; no forward communication.

    Backward: all-gather of the gradient shards over ``group`` (a replicated input's grad).
    """
    widths = prim.check_widths(widths, group)
    prim.check_method(method)
    if x_full.shape[dim] != sum(widths):
        raise ValueError(
            f"tensor has {x_full.shape[dim]} along dim {dim}, widths sum to {sum(widths)}"
        )
    return _Split.apply(x_full, dim % x_full.dim(), widths, group, method)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, group):  # type: ignore[override]
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def all_reduce(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """Sum of ``x`` [*] over ``group`` (all-reduce); backward is the identity.

    Megatron's reduce_from_tensor_model_parallel_region: for partial sums (row-parallel outputs)
    consumed identically on every rank.
    """
    if group is None:
        raise ValueError("group is required (None would silently mean the world group)")
    return _AllReduce.apply(x.contiguous(), group)


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, group):  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def copy_to_group(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """Identity on ``x`` [*]; backward all-reduces (sums) the gradient over ``group``.

    Megatron's copy_to_tensor_model_parallel_region: a replicated input feeding per-rank
    shards (column-parallel layers), whose gradient is the sum of every shard's part.
    """
    if group is None:
        raise ValueError("group is required (None would silently mean the world group)")
    return _CopyToGroup.apply(x, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, split_dim, cat_dim, split_widths, cat_widths, group, method):  # type: ignore[override]
        ctx.args = (split_dim, cat_dim, split_widths, cat_widths, group, method)
        return prim.all_to_all(
            x,
            split_dim=split_dim,
            cat_dim=cat_dim,
            split_widths=split_widths,
            cat_widths=cat_widths,
            group=group,
            method=method,
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        split_dim, cat_dim, split_widths, cat_widths, group, method = ctx.args
        grad = prim.all_to_all(
            grad,
            split_dim=cat_dim,
            cat_dim=split_dim,
            split_widths=cat_widths,
            cat_widths=split_widths,
            group=group,
            method=method,
        )
        return grad, None, None, None, None, None, None


def all_to_all_uneven(
    x: torch.Tensor,
    *,
    split_dim: int,
    cat_dim: int,
    split_widths: Sequence[int],
    cat_widths: Sequence[int],
    group: ProcessGroup,
    method: Method = "padded",
) -> torch.Tensor:
    """Re-shard ``x`` from ``cat_dim`` (widths ``cat_widths``) to ``split_dim`` (``split_widths``).

    x [.. sum(split_widths) at split_dim .., cat_widths[r] at cat_dim ..] ->
    y [.. split_widths[r] at split_dim .., sum(cat_widths) at cat_dim ..]
    (e.g. sequence-sharded -> head-sharded attention inputs). Backward: the inverse
    all-to-all (split_dim and cat_dim swapped) on ``group``.
    """
    split_widths = prim.check_widths(split_widths, group)
    cat_widths = prim.check_widths(cat_widths, group)
    prim.check_method(method)
    split_dim, cat_dim = split_dim % x.dim(), cat_dim % x.dim()
    return _AllToAll.apply(x, split_dim, cat_dim, split_widths, cat_widths, group, method)
