"""Collectives along one mesh axis, in mesh order, with autograd (the 2D layers' plumbing).

``axis="row"``: over ``mesh.row_group``; block t belongs to the rank at (i, t).
``axis="col"``: over ``mesh.col_group``; block t belongs to the rank at (t, j).
Blocks are addressed by mesh position and their owners by global rank, because torch orders
a group's ranks by global rank, which need not be the mesh order (see mesh.py). Every call
uses broadcast, reduce or all_reduce only (gloo and NCCL both have them); a block with no
elements is skipped alike on every rank.

=========================  ===================================  ===============================
function                   forward                              backward
=========================  ===================================  ===============================
gather_along               q broadcasts -> the full tensor      own block of the grad
split_along                own block (no communication)         q broadcasts of the grad blocks
reduce_scatter_along       q reduces: block t summed at owner t q broadcasts of the grad blocks
sum_over                   all_reduce (sum)                     all_reduce (sum) of the grad
=========================  ===================================  ===============================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from colossal_hetero.tp2d.layout import check_sizes, offsets
from colossal_hetero.tp2d.mesh import Mesh2D

Axis = Literal["row", "col"]


def _axis(mesh: Mesh2D, axis: Axis) -> tuple[Any, int, list[int]]:
    """(group, my index along the axis, owner global rank of every block)."""
    if axis == "row":
        return mesh.row_group, mesh.j, [mesh.row_peer(t) for t in range(mesh.q)]
    if axis == "col":
        return mesh.col_group, mesh.i, [mesh.col_peer(t) for t in range(mesh.q)]
    raise ValueError(f"axis must be 'row' or 'col', got {axis!r}")


def own_block(x: torch.Tensor, dim: int, sizes: Sequence[int], index: int) -> torch.Tensor:
    """x [..., sum(sizes), ...] -> block ``index`` along ``dim`` (a contiguous copy)."""
    return x.narrow(dim, offsets(sizes)[index], sizes[index]).contiguous()


def gather_blocks(
    x: torch.Tensor, mesh: Mesh2D, axis: Axis, dim: int, sizes: Sequence[int]
) -> torch.Tensor:
    """Own block [.., sizes[me], ..] -> full [.., sum(sizes), ..]: q broadcasts (no autograd)."""
    group, me, owners = _axis(mesh, axis)
    sizes = check_sizes(sizes, mesh.q, name=f"{axis} block sizes")
    if x.shape[dim] != sizes[me]:
        raise ValueError(f"block has {x.shape[dim]} along dim {dim}, sizes say {sizes[me]}")
    if mesh.q == 1:
        return x
    rows = x.movedim(dim, 0).contiguous()
    pieces, works = [], []
    for t, owner in enumerate(owners):
        piece = rows if t == me else rows.new_empty((sizes[t], *rows.shape[1:]))
        if piece.numel() > 0:
            works.append(dist.broadcast(piece, src=owner, group=group, async_op=True))
        pieces.append(piece)
    for work in works:
        work.wait()
    return torch.cat(pieces, 0).movedim(0, dim)


def reduce_scatter_blocks(
    x: torch.Tensor, mesh: Mesh2D, axis: Axis, dim: int, sizes: Sequence[int]
) -> torch.Tensor:
    """Full partial sums [.., sum(sizes), ..] -> own block of their sum: q reduces."""
    group, me, owners = _axis(mesh, axis)
    sizes = check_sizes(sizes, mesh.q, name=f"{axis} block sizes", total=x.shape[dim])
    if mesh.q == 1:
        return x
    # reduce may use its buffer as scratch on non-destination ranks: reduce copies.
    buffers = [piece.contiguous().clone() for piece in x.split(list(sizes), dim)]
    works = [
        dist.reduce(buf, dst=owner, group=group, async_op=True)
        for buf, owner in zip(buffers, owners, strict=True)
        if buf.numel() > 0
    ]
    for work in works:
        work.wait()
    return buffers[me]


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, mesh, axis, dim, sizes):  # type: ignore[override]
        ctx.args = (dim, sizes, _axis(mesh, axis)[1])
        return gather_blocks(x, mesh, axis, dim, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        dim, sizes, me = ctx.args
        return own_block(grad, dim, sizes, me), None, None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, mesh, axis, dim, sizes):  # type: ignore[override]
        ctx.args = (mesh, axis, dim, sizes)
        return own_block(x, dim, sizes, _axis(mesh, axis)[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        mesh, axis, dim, sizes = ctx.args
        return gather_blocks(grad.contiguous(), mesh, axis, dim, sizes), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, mesh, axis, dim, sizes):  # type: ignore[override]
        ctx.args = (mesh, axis, dim, sizes)
        return reduce_scatter_blocks(x, mesh, axis, dim, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        mesh, axis, dim, sizes = ctx.args
        return gather_blocks(grad.contiguous(), mesh, axis, dim, sizes), None, None, None, None


class _SumOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, group):  # type: ignore[override]
        ctx.group = group
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def gather_along(x: torch.Tensor, mesh: Mesh2D, axis: Axis, dim: int, sizes: Sequence[int]):
    """Full tensor from the blocks along ``axis``; backward keeps the own block of the grad.

    For a consumer that is the same on every rank of the axis (its grad is replicated).
    """
    return _Gather.apply(x, mesh, axis, dim % x.dim(), tuple(sizes))


def split_along(x: torch.Tensor, mesh: Mesh2D, axis: Axis, dim: int, sizes: Sequence[int]):
    """Own block of a tensor replicated along ``axis``; backward gathers the grad blocks."""
    sizes = check_sizes(sizes, mesh.q, name=f"{axis} block sizes", total=x.shape[dim])
    return _Split.apply(x, mesh, axis, dim % x.dim(), sizes)


def reduce_scatter_along(
    x: torch.Tensor, mesh: Mesh2D, axis: Axis, dim: int, sizes: Sequence[int]
) -> torch.Tensor:
    """Own block of the sum over ``axis`` of per-rank partial tensors; backward gathers."""
    return _ReduceScatter.apply(x, mesh, axis, dim % x.dim(), tuple(sizes))


def sum_over(x: torch.Tensor, mesh: Mesh2D, axis: Axis) -> torch.Tensor:
    """All-reduce (sum) over ``axis``, for partial sums each rank consumes its own way.

    Backward all-reduces the gradient too, since every rank's consumer contributes to it
    (e.g. the per-token statistics of a norm whose hidden dim is split over the row).
    """
    group = _axis(mesh, axis)[0]
    if mesh.q == 1:
        return x
    return _SumOver.apply(x, group)
