"""2D (SUMMA) tensor parallelism on 4 gloo ranks (q = 2) against dense single-process math.

Every rank builds the same seeded dense tensors, so each can compute the dense reference of
the whole product (or block) locally and compare its own block. Checks, grouped per spawn:
mesh groups (rows/columns partition the ranks, meet in one rank), every SUMMA kernel's blocks
and both gradients equal the dense product's (even and uneven sizes, default and permuted
mesh placements, i.e. TP not in the global rank order), exactly 2q collectives per kernel
with the block sizes of the SUMMA table, q = 1 meshes (plain matmul, no collective), and the
2D layers and transformer block (tests/distributed/tp2d_checks.py).

Tolerances: float64. A matmul entry is a sum of k products; two summation orders differ by at
most 2 (k - 1) u sum|terms| (tests/tolerances.py), and sum|terms| <= (|A| |B|) entrywise, so
each comparison uses that bound computed from the operands themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from colossal_hetero.tp2d import Mesh2D, summa_ab, summa_abt, summa_atb
from colossal_hetero.tp2d.layout import offsets
from tests.dist_utils import run_distributed
from tests.tolerances import sum_order_atol

DT = torch.float64


@contextlib.contextmanager
def counting() -> Iterator[list[tuple[str, tuple[int, ...], int]]]:
    """Record (op, global ranks of the group, numel) of every broadcast/reduce/all_reduce call."""
    calls: list[tuple[str, tuple[int, ...], int]] = []
    originals = {name: getattr(dist, name) for name in ("broadcast", "reduce", "all_reduce")}

    def wrap(name):
        def counted(tensor, *args, group=None, **kwargs):
            ranks = tuple(sorted(dist.get_process_group_ranks(group))) if group else ()
            calls.append((name, ranks, tensor.numel()))
            return originals[name](tensor, *args, group=group, **kwargs)

        return counted

    for name in originals:
        setattr(dist, name, wrap(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def randn(shape, seed, device=None):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=DT).to(device or "cpu")


def block(x, rows, cols, i, j):
    """Block (i, j) of a dense 2-D x cut by size lists ``rows`` and ``cols``."""
    return x[
        offsets(rows)[i] : offsets(rows)[i] + rows[i], offsets(cols)[j] : offsets(cols)[j] + cols[j]
    ]


def matmul_atol(a_abs, b_abs, k):
    """Bound for one matmul's entries in two summation orders (see the module docstring)."""
    return sum_order_atol(k, DT, float((a_abs @ b_abs).max()) if a_abs.numel() else 0.0)


def _check_kernel(mesh, kind, sizes3, seed):
    """One kernel: forward block, both gradient blocks, and the collectives it issued."""
    m, k, n = sizes3  # dense C [M, N] = op(A) op(B) with inner size K; block lists per dim
    i, j, q = mesh.i, mesh.j, mesh.q
    M, K, N = sum(m), sum(k), sum(n)
    a_shape, b_shape = {"ab": ((M, K), (K, N)), "abt": ((M, K), (N, K)), "atb": ((K, M), (K, N))}[
        kind
    ]
    a_full, b_full = randn(a_shape, seed), randn(b_shape, seed + 1)
    g_full = randn((M, N), seed + 2)
    a_cut = {"ab": (m, k), "abt": (m, k), "atb": (k, m)}[kind]
    b_cut = {"ab": (k, n), "abt": (n, k), "atb": (k, n)}[kind]
    fn, iterated = {"ab": (summa_ab, k), "abt": (summa_abt, n), "atb": (summa_atb, m)}[kind]
    a = block(a_full, *a_cut, i, j).clone().requires_grad_()
    b = block(b_full, *b_cut, i, j).clone().requires_grad_()
    with counting() as fwd_calls:
        c = fn(a, b, mesh, iterated)
    with counting() as bwd_calls:
        (c * block(g_full, m, n, i, j)).sum().backward()

    op = {"ab": lambda x, y: x @ y, "abt": lambda x, y: x @ y.t(), "atb": lambda x, y: x.t() @ y}[
        kind
    ]
    a_ref, b_ref = a_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    c_ref = op(a_ref, b_ref)
    (c_ref * g_full).sum().backward()
    atol = sum_order_atol(K, DT, float(op(a_full.abs(), b_full.abs()).max()))
    torch.testing.assert_close(c, block(c_ref.detach(), m, n, i, j), rtol=0, atol=atol)
    # dA sums over N (or M for atb's dA = B dC^T ... all inner sizes <= max(M, N, K)).
    inner = max(M, N, K)
    scale = float(max(a_full.abs().max(), b_full.abs().max(), 1.0) * g_full.abs().max() * inner)
    gtol = sum_order_atol(inner, DT, scale)
    torch.testing.assert_close(a.grad, block(a_ref.grad, *a_cut, i, j), rtol=0, atol=gtol)
    torch.testing.assert_close(b.grad, block(b_ref.grad, *b_cut, i, j), rtol=0, atol=gtol)
    _check_counts(mesh, kind, fwd_calls, m, k, n)
    assert len(bwd_calls) == 4 * q, (kind, bwd_calls)  # two kernels, 2q collectives each


def _check_counts(mesh, kind, calls, m, k, n):
    """2q collectives, on the groups and with the block sizes of the SUMMA table."""
    q, i, j = mesh.q, mesh.i, mesh.j
    row = tuple(sorted(mesh.layout.row_ranks(i)))
    col = tuple(sorted(mesh.layout.col_ranks(j)))
    if kind == "ab":
        expected = [("broadcast", row, m[i] * k[t]) for t in range(q)]
        expected += [("broadcast", col, k[t] * n[j]) for t in range(q)]
    elif kind == "abt":
        expected = [("broadcast", col, n[t] * k[j]) for t in range(q)]
        expected += [("reduce", row, m[i] * n[t]) for t in range(q)]
    else:
        expected = [("broadcast", row, k[i] * m[t]) for t in range(q)]
        expected += [("reduce", col, m[t] * n[j]) for t in range(q)]
    assert sorted(calls) == sorted(expected), (kind, calls, expected)


def _check_mesh(mesh, world_size):
    me = dist.get_rank()
    row = set(dist.get_process_group_ranks(mesh.row_group))
    col = set(dist.get_process_group_ranks(mesh.col_group))
    assert row & col == {me}
    assert row == set(mesh.layout.row_ranks(mesh.i)) and col == set(mesh.layout.col_ranks(mesh.j))
    assert mesh.global_rank(mesh.i, mesh.j) == me
    # Every rank's (i, j) is distinct: gather them and check the mesh is a bijection.
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, (mesh.i, mesh.j))
    assert sorted(everyone) == [(i, j) for i in range(mesh.q) for j in range(mesh.q)]


KERNEL_SIZES = {
    "even": ((2, 2), (3, 3), (2, 2)),
    "uneven": ((3, 1), (2, 5), (1, 4)),
    "zero": ((2, 0), (0, 3), (2, 1)),
}


def _kernels(mesh, world_size):
    _check_mesh(mesh, world_size)
    for seed, (kind, name) in enumerate(
        (kind, name) for kind in ("ab", "abt", "atb") for name in KERNEL_SIZES
    ):
        if name == "zero":
            continue  # empty blocks skip their collectives: counted separately below
        _check_kernel(mesh, kind, KERNEL_SIZES[name], 10 * seed)


def _zero_blocks(mesh):
    """Empty blocks are skipped alike on every rank; results still equal dense."""
    m, k, n = KERNEL_SIZES["zero"]
    a_full, b_full = randn((sum(m), sum(k)), 1), randn((sum(k), sum(n)), 2)
    c = summa_ab(block(a_full, m, k, mesh.i, mesh.j), block(b_full, k, n, mesh.i, mesh.j), mesh, k)
    ref = block(a_full @ b_full, m, n, mesh.i, mesh.j)
    torch.testing.assert_close(c, ref, rtol=0, atol=matmul_atol(a_full.abs(), b_full.abs(), sum(k)))


def _q1(rank):
    """Four 1 x 1 meshes (pure data parallel): plain matmul and no collective."""
    mesh = Mesh2D.build([[r] for r in range(4)])
    assert (mesh.q, mesh.i, mesh.j) == (1, 0, 0)
    a, b = randn((3, 2), rank), randn((2, 4), rank + 7)
    with counting() as calls:
        out = summa_ab(a, b, mesh, [2])
        out2 = summa_abt(a, b.t(), mesh, [4])
        out3 = summa_atb(a.t(), b, mesh, [3])
    assert calls == []
    for result in (out, out2, out3):
        torch.testing.assert_close(result, a @ b, rtol=0, atol=0)


def _errors():
    for lists in ([[0, 1, 2]], [[0, 1, 2, 3, 4]]):
        with pytest.raises(ValueError, match="parallel.tp: 2D tensor parallelism needs a square"):
            Mesh2D.build(lists)
    with pytest.raises(ValueError, match="not a bijection"):
        Mesh2D.build([[0, 1, 2, 3]], {0: (0, 0), 1: (0, 0), 2: (1, 0), 3: (1, 1)})
    with pytest.raises(ValueError, match="overlap"):
        Mesh2D.build([[0, 1, 2, 3], [3, 4, 5, 6]])


def _kernel_suite(rank, world_size, device):
    _errors()
    _q1(rank)
    # Default placement: positions in the order of the TP group's ranks.
    default = Mesh2D.from_tp_group(dist.group.WORLD)
    assert default.layout.positions == (0, 1, 2, 3)
    _kernels(default, world_size)
    _zero_blocks(default)
    # TP not in the global rank order: mesh (i, j) holds a permutation of the ranks, so the
    # row groups are {2, 0} and {3, 1} and every group-local index differs from the mesh's.
    placement = {2: (0, 0), 0: (0, 1), 3: (1, 0), 1: (1, 1)}
    permuted = Mesh2D.build([[0, 1, 2, 3]], placement)
    assert permuted.layout.positions == (2, 0, 3, 1)
    _kernels(permuted, world_size)


@pytest.mark.dist
@pytest.mark.numerics
@pytest.mark.timeout(180)
def test_tp2d_mesh_and_summa_kernels():
    run_distributed(_kernel_suite, world_size=4)
