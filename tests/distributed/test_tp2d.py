"""2D (SUMMA) tensor parallelism on 4 gloo ranks (q = 2) against dense single-process math.

Every rank builds the same seeded dense tensors, so each can compute the dense reference of
the whole product (or block) locally and compare its own block. Checks, grouped per spawn:
mesh groups (rows/columns partition the ranks, meet in one rank), every SUMMA kernel's blocks
and both gradients equal the dense product's (even and uneven sizes, default and permuted
mesh placements, i.e. TP not in the global rank order), exactly 2q collectives per kernel
with the block sizes of the SUMMA table, q = 1 meshes (plain matmul, no collective), 20 SGD
steps of a tiny 2D LM against single-process SGD (spawn 1); the 2D layers and a transformer
block against the dense block, forward and every gradient, the state round trip, the cost
model's per-rank collective calls and elements against those counted in a real run, and a
2-layer HF GPT-2 against the dense model (spawn 2).

Tolerances: float64. A matmul entry is a sum of k products; two summation orders differ by at
most 2 (k - 1) u sum|terms| (tests/tolerances.py), and sum|terms| <= (|A| |B|) entrywise, so
each kernel comparison uses that bound computed from the operands themselves; deeper chains
use chain_atol with a magnitude bound that the test checks on the reference.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from colossal_hetero.planner.tp2d_cost import LayerDims, Shares2D, cost_2d
from colossal_hetero.tp2d import Mesh2D, comm2d, summa_ab, summa_abt, summa_atb
from colossal_hetero.tp2d.block import Block2D
from colossal_hetero.tp2d.gpt2 import GPT2LM2D, GPT2Shares
from colossal_hetero.tp2d.layers import (
    Embedding2D,
    LayerNorm2D,
    LMHead2D,
    RMSNorm2D,
    dense_block,
    dense_vector_block,
    gather_batch_2d,
    gather_matrix,
    split_batch_2d,
    vocab_cross_entropy_2d,
)
from colossal_hetero.tp2d.layout import offsets
from tests.dist_utils import run_distributed
from tests.tolerances import chain_atol, sum_order_atol, transformer_depth

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
            if name != "all_reduce":  # SUMMA steps must be async to overlap with the GEMMs
                assert kwargs.get("async_op") is True, (name, kwargs)
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
    _check_training(permuted)


# ---------------------------------------------------------------- layers and the block

HEADS, HEAD_DIM = (3, 1), 4  # uneven: mesh column 0 holds 3 heads, column 1 one
WIDTHS = tuple(a * HEAD_DIM for a in HEADS)  # hidden widths per mesh column (12, 4); H = 16
FFN = (40, 24)  # MLP inner widths per column, 4H = 64
BATCH = (3, 1)  # batch shares per mesh row
VOCAB = (7, 4)  # vocab blocks; V = 11
SEQ = 5
H, V = sum(WIDTHS), sum(VOCAB)
# Dense key -> (row sizes or None for vectors, column sizes, fused parts).
CUTS = {
    "ln_1.weight": (None, WIDTHS, 1),
    "ln_1.bias": (None, WIDTHS, 1),
    "qkv.weight": (WIDTHS, WIDTHS, 3),
    "qkv.bias": (None, WIDTHS, 3),
    "proj.weight": (WIDTHS, WIDTHS, 1),
    "proj.bias": (None, WIDTHS, 1),
    "ln_2.weight": (None, WIDTHS, 1),
    "ln_2.bias": (None, WIDTHS, 1),
    "fc1.weight": (WIDTHS, FFN, 1),
    "fc1.bias": (None, FFN, 1),
    "fc2.weight": (FFN, WIDTHS, 1),
    "fc2.bias": (None, WIDTHS, 1),
}
# float64 through one block and its gradient: transformer_depth(1) chained reductions of at
# most 4H = 64 terms; MAGNITUDE bounds the reference's outputs and gradients (checked where
# used; parameter gradients sum over b s = 20 tokens, so reach ~30). Two orders differ by at
# most chain_atol(...) ~ 3.4e-11; a wrong block is off by O(1e-2).
MAGNITUDE = 50.0
BLOCK_ATOL = chain_atol(transformer_depth(1), 4 * H, DT, MAGNITUDE)


def dense_params(seed):
    """Dense block parameters, seeded identically on every rank."""
    shapes = {
        "qkv.weight": (H, 3 * H),
        "proj.weight": (H, H),
        "fc1.weight": (H, sum(FFN)),
        "fc2.weight": (sum(FFN), H),
    }
    params = {}
    for n, key in enumerate(CUTS):
        if key in shapes:
            params[key] = randn(shapes[key], seed + n) * 0.3
        else:
            width = CUTS[key][2] * sum(CUTS[key][1])
            base = 1.0 if key.endswith("weight") else 0.0
            params[key] = base + 0.1 * randn((width,), seed + n)
    return params


def dense_block_forward(x, p):
    """The dense single-process pre-norm block (GPT-2 layout, causal attention)."""
    B, S, _ = x.shape
    h = F.layer_norm(x, (H,), p["ln_1.weight"], p["ln_1.bias"], 1e-5)
    q, k, v = (h @ p["qkv.weight"] + p["qkv.bias"]).split(H, -1)
    a = sum(HEADS)

    def heads(t):
        return t.reshape(B, S, a, HEAD_DIM).transpose(1, 2)

    att = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    x = x + att.transpose(1, 2).reshape(B, S, H) @ p["proj.weight"] + p["proj.bias"]
    h = F.layer_norm(x, (H,), p["ln_2.weight"], p["ln_2.bias"], 1e-5)
    return x + F.gelu(h @ p["fc1.weight"] + p["fc1.bias"]) @ p["fc2.weight"] + p["fc2.bias"]


def act_block(x_full, mesh):
    """Rank (i, j)'s block [b_i, S, h_j] of a dense activation [B, S, H]."""
    b0, c0 = offsets(BATCH)[mesh.i], offsets(WIDTHS)[mesh.j]
    return x_full[b0 : b0 + BATCH[mesh.i], :, c0 : c0 + WIDTHS[mesh.j]]


def param_block(key, dense, mesh):
    rows, cols, parts = CUTS[key]
    if rows is None:
        return dense_vector_block(dense, cols, mesh.j, parts)
    return dense_block(dense, rows, cols, mesh.i, mesh.j, parts)


def local_params(block2d):
    """Dense key -> this rank's parameter of a Block2D."""
    return {name.replace("attn.", ""): p for name, p in block2d.named_parameters()}


def _check_block(mesh):
    """Forward, input and every parameter gradient of Block2D equal the dense block's."""
    params = dense_params(100)
    model = Block2D(mesh, HEADS, HEAD_DIM, FFN, dtype=DT)
    model.load_dense(params)
    x_full, g_full = randn((sum(BATCH), SEQ, H), 1), randn((sum(BATCH), SEQ, H), 2)
    x = act_block(x_full, mesh).clone().requires_grad_()
    with counting() as calls:
        out = model(x)
        (out * act_block(g_full, mesh)).sum().backward()
    ref_params = {k: v.clone().requires_grad_() for k, v in params.items()}
    x_ref = x_full.clone().requires_grad_()
    ref = dense_block_forward(x_ref, ref_params)
    (ref * g_full).sum().backward()
    grads = [p.grad.abs().max() for p in ref_params.values()]
    assert max(ref.abs().max(), x_ref.grad.abs().max(), *grads) < MAGNITUDE  # BLOCK_ATOL's bound
    torch.testing.assert_close(out, act_block(ref.detach(), mesh), rtol=0, atol=BLOCK_ATOL)
    torch.testing.assert_close(x.grad, act_block(x_ref.grad, mesh), rtol=0, atol=BLOCK_ATOL)
    mine = local_params(model)
    assert sorted(mine) == sorted(CUTS)
    for key, param in mine.items():
        expected = param_block(key, ref_params[key].grad, mesh)
        torch.testing.assert_close(param.grad, expected, rtol=0, atol=BLOCK_ATOL, msg=key)
    return calls


def _check_round_trip(mesh):
    """Blocks -> dense (gather_matrix / row gathers) -> blocks is the identity, bit for bit."""
    params = dense_params(7)
    model = Block2D(mesh, HEADS, HEAD_DIM, FFN, dtype=DT)
    model.load_dense(params)
    for key, param in local_params(model).items():
        rows, cols, parts = CUTS[key]
        if rows is None:
            full = comm2d.gather_blocks(param.detach(), mesh, "row", 0, [parts * c for c in cols])
            full = torch.cat(
                [
                    full[offsets(cols)[j] * parts :][: parts * cols[j]].view(parts, -1)
                    for j in range(mesh.q)
                ],
                1,
            ).reshape(-1)
        else:
            full = gather_matrix(param.detach(), mesh, rows, [parts * c for c in cols])
            full = torch.cat(
                [
                    full[:, offsets(cols)[j] * parts :][:, : parts * cols[j]].reshape(
                        full.shape[0], parts, -1
                    )
                    for j in range(mesh.q)
                ],
                2,
            )
            full = full.reshape(full.shape[0], -1)
        torch.testing.assert_close(full, params[key], rtol=0, atol=0, msg=key)


def _check_norms_and_helpers(mesh):
    x_full = randn((sum(BATCH), SEQ, H), 3) * 3 + 1
    w, b = 1 + 0.1 * randn((H,), 4), 0.1 * randn((H,), 5)
    g_full = randn((sum(BATCH), SEQ, H), 6)
    for norm in ("layer", "rms"):
        layer = (LayerNorm2D if norm == "layer" else RMSNorm2D)(mesh, WIDTHS, dtype=DT)
        layer.load_dense(w, b)
        x = act_block(x_full, mesh).clone().requires_grad_()
        (layer(x) * act_block(g_full, mesh)).sum().backward()
        x_ref, w_ref = x_full.clone().requires_grad_(), w.clone().requires_grad_()
        if norm == "layer":
            ref = F.layer_norm(x_ref, (H,), w_ref, b, 1e-5)
        else:
            ref = x_ref * torch.rsqrt(x_ref.pow(2).mean(-1, keepdim=True) + 1e-6) * w_ref
        (ref * g_full).sum().backward()
        torch.testing.assert_close(x.grad, act_block(x_ref.grad, mesh), rtol=0, atol=BLOCK_ATOL)
        torch.testing.assert_close(
            layer.weight.grad,
            dense_vector_block(w_ref.grad, WIDTHS, mesh.j),
            rtol=0,
            atol=BLOCK_ATOL,
        )
    # Batch split/gather: inverse of each other; split's backward gathers the gradient.
    x = x_full.clone().requires_grad_()
    part = split_batch_2d(x, mesh, BATCH, WIDTHS)
    torch.testing.assert_close(part, act_block(x_full, mesh), rtol=0, atol=0)
    whole = gather_batch_2d(part.detach(), mesh, BATCH, WIDTHS)
    torch.testing.assert_close(whole, x_full, rtol=0, atol=0)
    (part * act_block(g_full, mesh)).sum().backward()
    torch.testing.assert_close(x.grad, g_full, rtol=0, atol=0)


class TinyLM2D(torch.nn.Module):
    """Embedding -> Block2D -> LayerNorm -> tied LM head, on the mesh."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        self.emb = Embedding2D(mesh, VOCAB, WIDTHS, dtype=DT)
        self.block = Block2D(mesh, HEADS, HEAD_DIM, FFN, dtype=DT)
        self.ln_f = LayerNorm2D(mesh, WIDTHS, dtype=DT)
        self.head = LMHead2D(mesh, VOCAB, WIDTHS, weight=self.emb.weight)

    def forward(self, ids, targets):
        h = self.ln_f(self.block(self.emb(ids, BATCH)))
        local_targets = split_batch_2d(targets, self.mesh, BATCH, None).reshape(-1)
        return vocab_cross_entropy_2d(self.head(h), local_targets, self.mesh, VOCAB)


def dense_lm_loss(ids, targets, p):
    h = dense_block_forward(F.embedding(ids, p["emb"]), p)
    h = F.layer_norm(h, (H,), p["ln_f.weight"], p["ln_f.bias"], 1e-5)
    return F.cross_entropy((h @ p["emb"].t()).reshape(-1, V), targets.reshape(-1))


def _check_training(mesh, steps=20, lr=0.05):
    """SGD on the 2D tiny LM follows single-process SGD: every step's loss, final weights."""
    dense = dense_params(200)
    dense["emb"] = randn((V, H), 300)
    dense["ln_f.weight"], dense["ln_f.bias"] = 1 + 0.1 * randn((H,), 301), 0.1 * randn((H,), 302)
    model = TinyLM2D(mesh)
    model.block.load_dense(dense)
    model.emb.load_dense(dense["emb"])
    model.ln_f.load_dense(dense["ln_f.weight"], dense["ln_f.bias"])
    ref = {k: v.clone().requires_grad_() for k, v in dense.items()}
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(ref.values(), lr=lr)
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        ids = torch.randint(0, V, (sum(BATCH), SEQ), generator=g)
        targets = torch.randint(0, V, (sum(BATCH), SEQ), generator=g)
        targets[0, 0] = -100  # an ignored token: excluded from the mean on both sides
        loss, ref_loss = model(ids, targets), dense_lm_loss(ids, targets, ref)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=steps * BLOCK_ATOL)
        for o, value in ((opt, loss), (ref_opt, ref_loss)):
            o.zero_grad()
            value.backward()
            o.step()
    # Errors of each step add (first order; lr * curvature < 1 here, nothing amplifies them).
    atol = steps * BLOCK_ATOL
    mine = local_params(model.block)
    for key, param in mine.items():
        torch.testing.assert_close(
            param, param_block(key, ref[key].detach(), mesh), rtol=0, atol=atol
        )
    emb = dense_block(ref["emb"].detach(), VOCAB, WIDTHS, mesh.i, mesh.j)
    torch.testing.assert_close(model.emb.weight, emb, rtol=0, atol=atol)
    assert (
        model.emb.weight - dense_block(dense["emb"], VOCAB, WIDTHS, mesh.i, mesh.j)
    ).abs().max() > 1e-4


def _check_cost_model(mesh, calls):
    """The cost model's per-rank collectives of one layer equal those the block issued."""
    row = tuple(sorted(mesh.layout.row_ranks(mesh.i)))
    counted: dict = {}
    for op, ranks, numel in calls:
        entry = counted.setdefault((op, "row" if ranks == row else "col"), [0, 0])
        entry[0] += 1
        entry[1] += numel
    dims = LayerDims(batch=sum(BATCH), seq=SEQ, hidden=H, heads=sum(HEADS), ffn=sum(FFN))
    model = cost_2d(dims, Shares2D(BATCH, HEADS, FFN), mesh.i, mesh.j)
    assert counted == model.comm.calls, (counted, model.comm.calls)
    # Parameters too: what this rank holds.
    return model


def _layer_suite(rank, world_size, device):
    placement = {2: (0, 0), 0: (0, 1), 3: (1, 0), 1: (1, 1)}  # TP not in rank order
    for mesh in (Mesh2D.build([[0, 1, 2, 3]]), Mesh2D.build([[0, 1, 2, 3]], placement)):
        calls = _check_block(mesh)
        model = _check_cost_model(mesh, calls)
        held = sum(p.numel() for p in Block2D(mesh, HEADS, HEAD_DIM, FFN).parameters())
        assert held == model.params
        _check_round_trip(mesh)
        _check_norms_and_helpers(mesh)
    _check_gpt2(mesh)  # the permuted placement


@pytest.mark.dist
@pytest.mark.numerics
@pytest.mark.timeout(240)
def test_tp2d_layers_block_and_cost_model():
    """Spawn 2: Block2D vs dense (both placements), the cost model's counts, GPT-2."""
    run_distributed(_layer_suite, world_size=4)


@pytest.mark.dist
@pytest.mark.numerics
@pytest.mark.timeout(240)
def test_tp2d_mesh_kernels_and_training():
    """Spawn 1: mesh, SUMMA kernels (default and permuted placement), 20 SGD steps."""
    run_distributed(_kernel_suite, world_size=4)


def _check_gpt2(mesh):
    """A 2-layer HF GPT-2 on the mesh: loss and gradients equal the dense HF model's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=V,
        n_positions=8,
        n_embd=H,
        n_layer=2,
        n_head=sum(HEADS),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(11)  # the same dense weights on every rank
    dense = GPT2LMHeadModel(config).to(DT)
    reference = copy.deepcopy(dense)
    model = GPT2LM2D(dense, mesh, GPT2Shares(BATCH, HEADS, FFN, VOCAB))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (sum(BATCH), SEQ), generator=g)
    labels = ids.clone()
    labels[1, 2] = -100
    loss = model(ids, labels)
    loss.backward()
    # HF's own loss upcasts to float32; the float64 reference shifts and scores by hand.
    ref_logits = reference(ids).logits
    ref_loss = F.cross_entropy(ref_logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
    ref_loss.backward()
    grads = [p.grad.abs().max() for p in reference.parameters()]
    assert max(ref_loss.abs(), ref_logits.abs().max(), *grads) < MAGNITUDE  # atol's bound
    atol = chain_atol(transformer_depth(2), 4 * H, DT, MAGNITUDE)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=atol)
    ref_h = reference.transformer
    pairs = [
        (model.wte.weight, dense_block(ref_h.wte.weight.grad, VOCAB, WIDTHS, mesh.i, mesh.j)),
        (model.wpe.weight, dense_vector_block(ref_h.wpe.weight.grad, WIDTHS, mesh.j)),
        (model.ln_f.weight, dense_vector_block(ref_h.ln_f.weight.grad, WIDTHS, mesh.j)),
    ]
    for layer in (0, 1):
        mine, ref = model.h[layer], ref_h.h[layer]
        pairs += [
            (mine.attn.c_attn.weight, param_block("qkv.weight", ref.attn.c_attn.weight.grad, mesh)),
            (mine.attn.c_attn.bias, param_block("qkv.bias", ref.attn.c_attn.bias.grad, mesh)),
            (mine.mlp.c_proj.weight, param_block("fc2.weight", ref.mlp.c_proj.weight.grad, mesh)),
            (mine.ln_1.bias, param_block("ln_1.bias", ref.ln_1.bias.grad, mesh)),
        ]
    for param, expected in pairs:
        torch.testing.assert_close(param.grad, expected, rtol=0, atol=atol)
    with pytest.raises(ValueError, match="dropout 0"):
        GPT2LM2D(
            GPT2LMHeadModel(GPT2Config(n_embd=16, n_head=4, n_layer=1)),
            mesh,
            GPT2Shares(BATCH, HEADS, FFN, VOCAB),
        )
