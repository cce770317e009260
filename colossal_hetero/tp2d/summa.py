"""SUMMA matrix products over a q x q mesh, as autograd functions (Optimus' three kernels).

Block layout: a dense matrix is cut into q x q blocks by a size list over its rows (indexed
by mesh row i) and one over its columns (indexed by mesh column j); rank (i, j) holds block
(i, j). Sizes may be uneven (and zero); each kernel needs only the size list of the dimension
it iterates over (``sizes``), the others are read from the local blocks.

=======  ==========================  =========================================================
kernel   blocks on rank (i, j)       step t = 0..q-1 (2 collectives per step, 2q per call)
=======  ==========================  =========================================================
ab       A [m_i, k_j], B [k_i, n_j]  broadcast A_it over the row group from (i, t) and B_tj
         C = A B   [m_i, n_j]        over the column group from (t, j); C_ij += A_it B_tj
                                     (``sizes`` = k)
abt      A [m_i, k_j], B [n_i, k_j]  broadcast B_tj over the column group from (t, j);
         C = A B^T [m_i, n_j]        P = A_ij B_tj^T [m_i, n_t]; reduce P over the row group to
                                     (i, t), which keeps it as C_it (``sizes`` = n)
atb      A [k_i, m_j], B [k_i, n_j]  broadcast A_it over the row group from (i, t);
         C = A^T B [m_i, n_j]        P = A_it^T B_ij [m_t, n_j]; reduce P over the column group
                                     to (t, j), which keeps it as C_tj (``sizes`` = m)
=======  ==========================  =========================================================

Backward (each gradient is another kernel, so a backward costs two kernels, 4q collectives):
ab: dA = abt(dC, B), dB = atb(A, dC); abt: dA = ab(dC, B), dB = atb(dC, A);
atb: dA = abt(B, dC), dB = ab(A, dC).

Overlap: the broadcasts of step t + 1 are issued (async) before the GEMM of step t, and the
reduces are async and waited for at the end, so communication runs behind compute wherever
the backend progresses async work in the background (gloo's worker threads, NCCL's streams).
Only broadcast and reduce are used, which both backends have. Sources and destinations are
global ranks from the mesh (``Mesh2D.row_peer``/``col_peer``), never group-local indices. A
block with no elements is skipped on every rank of its group alike (all know its size).

ZERO-resizing (``kept``, tp2d/resize.py): one rank may compute each step's GEMM over a kept
subset of the iterated dimension's block t only (``kept[t]``, local indices in
range(sizes[t])). In ab that is the reduction (the dropped entries add nothing to C); in abt
and atb it is the partial's columns (rows) that rank does not compute: they are ``fill``
(0: no contribution to the reduced sum). Every broadcast and reduce is unchanged (the same
count, groups and sizes), so the other ranks neither know nor care; a kernel with ``kept``
backpropagates through the two others with the same ``kept``, which is the exact gradient
of the resized product when ``fill`` is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from colossal_hetero.tp2d.layout import check_sizes
from colossal_hetero.tp2d.mesh import Mesh2D

Works = list[Any]
Kept = Sequence[torch.Tensor] | None
"""Per step t, the local indices this rank computes of the iterated block t; None: all."""


def _bcast(buf: torch.Tensor, src: int, group: Any, works: Works) -> torch.Tensor:
    if buf.numel() > 0 and group.size() > 1:  # a 1 x 1 mesh (resized, q = 1) sends nothing
        works.append(dist.broadcast(buf, src=src, group=group, async_op=True))
    return buf


def _reduce(buf: torch.Tensor, dst: int, group: Any, works: Works) -> None:
    if buf.numel() > 0 and group.size() > 1:
        works.append(dist.reduce(buf, dst=dst, group=group, async_op=True))


def _wait(works: Works) -> None:
    for work in works:
        work.wait()
    works.clear()


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


def _steps(kept: Kept, q: int) -> Kept:
    if kept is not None and len(kept) != q:
        raise ValueError(f"summa kept: need one index tensor per step ({q}), got {len(kept)}")
    return kept


def ab(
    a: torch.Tensor, b: torch.Tensor, mesh: Mesh2D, k: Sequence[int], kept: Kept = None
) -> torch.Tensor:
    """C_ij = sum_t A_it B_tj (no autograd). A [m_i, k_j], B [k_i, n_j] -> C [m_i, n_j].

    ``kept``: step t sums over A_it[:, kept[t]] B_tj[kept[t]] only (see the module docstring).
    """
    q, i, j = mesh.q, mesh.i, mesh.j
    k, kept = check_sizes(k, q, name="summa ab k sizes"), _steps(kept, mesh.q)
    _check(a.dim() == 2 and b.dim() == 2, "summa ab takes 2-D blocks")
    _check(
        a.shape[1] == k[j] and b.shape[0] == k[i], f"summa ab: blocks {a.shape}, {b.shape} vs k {k}"
    )
    if q == 1 and kept is None:
        return a @ b
    a, b = a.contiguous(), b.contiguous()
    m, n = a.shape[0], b.shape[1]
    out = a.new_zeros((m, n))

    def issue(t: int) -> tuple[torch.Tensor, torch.Tensor, Works]:
        works: Works = []
        a_t = _bcast(
            a if t == j else a.new_empty((m, k[t])), mesh.row_peer(t), mesh.row_group, works
        )
        b_t = _bcast(
            b if t == i else b.new_empty((k[t], n)), mesh.col_peer(t), mesh.col_group, works
        )
        return a_t, b_t, works

    pending = issue(0)
    for t in range(q):
        a_t, b_t, works = pending
        if t + 1 < q:
            pending = issue(t + 1)
        _wait(works)
        if kept is None:
            out.addmm_(a_t, b_t)
        elif kept[t].numel():
            out.addmm_(a_t.index_select(1, kept[t]), b_t.index_select(0, kept[t]))
    return out


def abt(
    a: torch.Tensor,
    b: torch.Tensor,
    mesh: Mesh2D,
    n: Sequence[int],
    kept: Kept = None,
    fill: float = 0.0,
) -> torch.Tensor:
    """C_ij = sum_l A_il B_jl^T (no autograd). A [m_i, k_j], B [n_i, k_j] -> C [m_i, n_j].

    ``kept``: step t's partial [m_i, n_t] has only columns kept[t] computed, the rest ``fill``.
    """
    q, i, j = mesh.q, mesh.i, mesh.j
    n, kept = check_sizes(n, q, name="summa abt n sizes"), _steps(kept, mesh.q)
    _check(a.dim() == 2 and b.dim() == 2, "summa abt takes 2-D blocks")
    _check(
        a.shape[1] == b.shape[1] and b.shape[0] == n[i],
        f"summa abt: blocks {a.shape}, {b.shape} vs n {n}",
    )
    if q == 1 and kept is None:
        return a @ b.t()
    a, b = a.contiguous(), b.contiguous()
    kj = b.shape[1]

    def issue(t: int) -> tuple[torch.Tensor, Works]:
        works: Works = []
        b_t = _bcast(
            b if t == i else b.new_empty((n[t], kj)), mesh.col_peer(t), mesh.col_group, works
        )
        return b_t, works

    reduces: Works = []
    out = None
    pending = issue(0)
    for t in range(q):
        b_t, works = pending
        if t + 1 < q:
            pending = issue(t + 1)
        _wait(works)
        if kept is None:
            partial = a @ b_t.t()  # [m_i, n_t]: this rank's share of C_it
        else:
            partial = a.new_full((a.shape[0], n[t]), fill)
            partial.index_copy_(1, kept[t], a @ b_t.index_select(0, kept[t]).t())
        _reduce(partial, mesh.row_peer(t), mesh.row_group, reduces)
        if t == j:
            out = partial
    _wait(reduces)
    assert out is not None
    return out


def atb(
    a: torch.Tensor,
    b: torch.Tensor,
    mesh: Mesh2D,
    m: Sequence[int],
    kept: Kept = None,
    fill: float = 0.0,
) -> torch.Tensor:
    """C_ij = sum_l A_li^T B_lj (no autograd). A [k_i, m_j], B [k_i, n_j] -> C [m_i, n_j].

    ``kept``: step t's partial [m_t, n_j] has only rows kept[t] computed, the rest ``fill``.
    """
    q, i, j = mesh.q, mesh.i, mesh.j
    m, kept = check_sizes(m, q, name="summa atb m sizes"), _steps(kept, mesh.q)
    _check(a.dim() == 2 and b.dim() == 2, "summa atb takes 2-D blocks")
    _check(
        a.shape[0] == b.shape[0] and a.shape[1] == m[j],
        f"summa atb: blocks {a.shape}, {b.shape} vs m {m}",
    )
    if q == 1 and kept is None:
        return a.t() @ b
    a, b = a.contiguous(), b.contiguous()
    ki = a.shape[0]

    def issue(t: int) -> tuple[torch.Tensor, Works]:
        works: Works = []
        a_t = _bcast(
            a if t == j else a.new_empty((ki, m[t])), mesh.row_peer(t), mesh.row_group, works
        )
        return a_t, works

    reduces: Works = []
    out = None
    pending = issue(0)
    for t in range(q):
        a_t, works = pending
        if t + 1 < q:
            pending = issue(t + 1)
        _wait(works)
        if kept is None:
            partial = a_t.t() @ b  # [m_t, n_j]: this rank's share of C_tj
        else:
            partial = b.new_full((m[t], b.shape[1]), fill)
            partial.index_copy_(0, kept[t], a_t.index_select(1, kept[t]).t() @ b)
        _reduce(partial, mesh.col_peer(t), mesh.col_group, reduces)
        if t == i:
            out = partial
    _wait(reduces)
    assert out is not None
    return out


class _AB(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a, b, mesh, sizes, kept, fill):  # type: ignore[override]
        ctx.save_for_backward(a, b)
        ctx.mesh, ctx.sizes, ctx.kept, ctx.fill = mesh, sizes, kept, fill
        return ab(a, b, mesh, sizes, kept)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        a, b = ctx.saved_tensors
        grad, args = grad.contiguous(), (ctx.mesh, ctx.sizes, ctx.kept)
        da = abt(grad, b, *args, ctx.fill) if ctx.needs_input_grad[0] else None
        db = atb(a, grad, *args, ctx.fill) if ctx.needs_input_grad[1] else None
        return da, db, None, None, None, None


class _ABT(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a, b, mesh, sizes, kept, fill):  # type: ignore[override]
        ctx.save_for_backward(a, b)
        ctx.mesh, ctx.sizes, ctx.kept, ctx.fill = mesh, sizes, kept, fill
        return abt(a, b, mesh, sizes, kept, fill)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        a, b = ctx.saved_tensors
        grad, args = grad.contiguous(), (ctx.mesh, ctx.sizes, ctx.kept)
        da = ab(grad, b, *args) if ctx.needs_input_grad[0] else None
        db = atb(grad, a, *args, ctx.fill) if ctx.needs_input_grad[1] else None
        return da, db, None, None, None, None


class _ATB(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a, b, mesh, sizes, kept, fill):  # type: ignore[override]
        ctx.save_for_backward(a, b)
        ctx.mesh, ctx.sizes, ctx.kept, ctx.fill = mesh, sizes, kept, fill
        return atb(a, b, mesh, sizes, kept, fill)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        a, b = ctx.saved_tensors
        grad, args = grad.contiguous(), (ctx.mesh, ctx.sizes, ctx.kept)
        da = abt(b, grad, *args, ctx.fill) if ctx.needs_input_grad[0] else None
        db = ab(a, grad, *args) if ctx.needs_input_grad[1] else None
        return da, db, None, None, None, None


def summa_ab(
    a: torch.Tensor,
    b: torch.Tensor,
    mesh: Mesh2D,
    k: Sequence[int],
    *,
    kept: Kept = None,
    fill: float = 0.0,
) -> torch.Tensor:
    """Differentiable C = A B; A [m_i, k_j], B [k_i, n_j] -> C [m_i, n_j] (see module table).

    ``kept`` / ``fill``: ZERO-resizing of this rank's steps (module docstring), the backward
    kernels resized alike (``fill`` in the dropped entries of dA and dB's partials).
    """
    k = check_sizes(k, mesh.q, name="summa ab k sizes")
    return _AB.apply(a, b, mesh, k, _steps(kept, mesh.q), fill)


def summa_abt(
    a: torch.Tensor,
    b: torch.Tensor,
    mesh: Mesh2D,
    n: Sequence[int],
    *,
    kept: Kept = None,
    fill: float = 0.0,
) -> torch.Tensor:
    """Differentiable C = A B^T; A [m_i, k_j], B [n_i, k_j] -> C [m_i, n_j]."""
    n = check_sizes(n, mesh.q, name="summa abt n sizes")
    return _ABT.apply(a, b, mesh, n, _steps(kept, mesh.q), fill)


def summa_atb(
    a: torch.Tensor,
    b: torch.Tensor,
    mesh: Mesh2D,
    m: Sequence[int],
    *,
    kept: Kept = None,
    fill: float = 0.0,
) -> torch.Tensor:
    """Differentiable C = A^T B; A [k_i, m_j], B [k_i, n_j] -> C [m_i, n_j]."""
    m = check_sizes(m, mesh.q, name="summa atb m sizes")
    return _ATB.apply(a, b, mesh, m, _steps(kept, mesh.q), fill)
