"""ZERO-resizing inside SUMMA steps (tp2d/resize.py) on 4 gloo ranks (q = 2), one spawn.

Reference: the dense single-process layer in which the straggler's output block (its batch
share, its column's outputs) sums over the kept reduction entries only,
    y = x W + b - M * (x[..., D] W[D, :]),   M = 1 on the straggler's block, 0 elsewhere,
differentiated by autograd (float64). Each rank compares its blocks of y, dx, dW, db.
Checks: two straggler positions on two placements (TP in and out of rank order); the
collectives (op, group, size) equal the plain layer's; every entry kept, eval and no_grad
are bitwise the plain layer; impute_value lands in exactly the straggler's shares; bf16;
Priority2D's scores equal the dense weight change per mesh column and the kept entries are
the same on every rank; freezing keeps the dropped rows; bad arguments raise ValueError.

Tolerances: two orders of a sum of k terms differ by at most 2 (k - 1) u sum|terms|
(tests/tolerances.py). The reference's y and gradients are one matmul plus one subtraction
of a partial matmul of the same terms: chain_atol(2, K, ...) with the dense |x| |W| bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colossal_hetero.balance.inlayer import InLayerPlan, Offload
from colossal_hetero.balance.ops import complement, frozen_columns, kept_count
from colossal_hetero.tp2d import Mesh2D
from colossal_hetero.tp2d.block import Block2D
from colossal_hetero.tp2d.layers import Linear2D, dense_block, dense_vector_block, gather_matrix
from colossal_hetero.tp2d.layout import offsets
from colossal_hetero.tp2d.resize import (
    LayerOps2D,
    Priority2D,
    attach_resize_2d,
    detach_resize_2d,
    freeze_targets_2d,
    kept_for_slowdown,
    linear_layers,
)
from tests.dist_utils import run_distributed
from tests.distributed.test_tp2d import counting, randn
from tests.tolerances import chain_atol, unit_roundoff

DT = torch.float64
IN, OUT, BATCH, SEQ = (5, 3), (3, 4), (3, 1), 2  # uneven blocks: K = 8, N = 7, B = 4
K, N, B = sum(IN), sum(OUT), sum(BATCH)
KEPT = torch.tensor([0, 2, 3, 6])  # spans both reduction blocks (t = 0: 0, 2, 3; t = 1: 1)
KEPT2 = torch.tensor([1, 4, 5, 7])  # a second straggler's: block 1 only partly kept
PERMUTED = {2: (0, 0), 0: (0, 1), 3: (1, 0), 1: (1, 1)}  # TP not in the global rank order


def act(x, mesh, cols):
    """Rank (i, j)'s block [b_i, S, cols_j] of a dense [B, S, sum(cols)] activation."""
    b0, c0 = offsets(BATCH)[mesh.i], offsets(cols)[mesh.j]
    return x[b0 : b0 + BATCH[mesh.i], :, c0 : c0 + cols[mesh.j]]


def dense_resized(x, w, b, kept):
    """The dense reference (module docstring) for {straggler position: kept}: differentiable
    in x, w, b."""
    y = x @ w + b
    for (i, j), entries in kept.items():
        dropped = complement(entries, K)
        mask = torch.zeros(B, 1, N, dtype=x.dtype)
        b0, c0 = offsets(BATCH), offsets(OUT)
        mask[b0[i] : b0[i] + BATCH[i], :, c0[j] : c0[j] + OUT[j]] = 1
        y = y - mask * (x[..., dropped] @ w[dropped])
    return y


def _inputs(dtype=DT, seed=0):
    tensors = [randn(shape, seed + n) for n, shape in enumerate([(B, SEQ, K), (K, N), (N,)])]
    tensors.append(randn((B, SEQ, N), seed + 3))
    return [t.to(dtype).to(DT) for t in tensors]  # exact in ``dtype``, held in float64


def _run_layer(mesh, inputs, dtype=DT, kept=None, impute=0.0, *, grad=True):
    """This rank's y, dx, dW, db of a Linear2D (resized by {position: kept} when given)."""
    x, w, b, dy = inputs
    layer = Linear2D(mesh, IN, OUT, dtype=dtype)
    layer.load_dense(w.to(dtype), b.to(dtype))
    if kept is not None:
        attach_resize_2d(layer, {p: {"": v} for p, v in kept.items()}, impute_value=impute)
    xb = act(x, mesh, IN).to(dtype).clone().requires_grad_(grad)
    with counting() as calls:
        y = layer(xb)
        if grad:
            (y * act(dy, mesh, OUT).to(dtype)).sum().backward()
    if not grad:
        return {"y": y}, calls
    return {"y": y, "dx": xb.grad, "dw": layer.weight.grad, "db": layer.bias.grad}, calls


def _reference(mesh, inputs, kept):
    x, w, b, dy = (t.clone().requires_grad_() for t in inputs)
    y = dense_resized(x, w, b, kept)
    (y * dy).sum().backward()
    mine = {
        "y": act(y.detach(), mesh, OUT),
        "dx": act(x.grad, mesh, IN),
        "dw": dense_block(w.grad, IN, OUT, mesh.i, mesh.j),
        "db": dense_vector_block(b.grad, OUT, mesh.j),
    }
    xa, wa, ba, ga = (t.abs().detach() for t in inputs)
    scale = {  # sum|terms| bounds of each dense result
        "y": float((xa @ wa + ba).max()),
        "dx": float((ga @ wa.t()).max()),
        "dw": float((xa.flatten(0, 1).t() @ ga.flatten(0, 1)).max()),
        "db": float(ga.flatten(0, 1).sum(0).max()),
    }
    return mine, scale


def _check_exact(mesh, kept):
    """Resized = dense reference; the same collectives as the plain layer; not the plain one."""
    inputs = _inputs()
    got, calls = _run_layer(mesh, inputs, kept=kept)
    plain, plain_calls = _run_layer(mesh, inputs)
    assert sorted(calls) == sorted(plain_calls) and len(calls) == 3 * 2 * mesh.q + 1
    expected, scale = _reference(mesh, inputs, kept)
    for key, value in got.items():
        atol = chain_atol(2, max(K, N, B * SEQ), DT, scale[key])
        torch.testing.assert_close(value, expected[key], rtol=0, atol=atol, msg=key)
    if (mesh.i, mesh.j) in kept:  # the resized block really differs from the whole one
        assert (plain["y"] - got["y"]).abs().max() > 1e-3


def _check_untouched(mesh):
    """Every entry kept, eval mode, no_grad: bitwise the plain layer."""
    inputs = _inputs(seed=20)
    plain, _ = _run_layer(mesh, inputs)
    whole, _ = _run_layer(mesh, inputs, kept={(0, 0): torch.arange(K), (1, 1): torch.arange(K)})
    for key in plain:
        assert torch.equal(whole[key], plain[key]), key
    layer = Linear2D(mesh, IN, OUT, dtype=DT)
    layer.load_dense(inputs[1], inputs[2])
    xb = act(inputs[0], mesh, IN)
    reference = layer(xb).detach()
    attach_resize_2d(layer, {(mesh.i, mesh.j): {"": KEPT}})  # this rank a straggler
    with torch.no_grad():
        assert torch.equal(layer(xb), reference)
    layer.eval()
    assert torch.equal(layer(xb.clone().requires_grad_()).detach(), reference)
    layer.train()
    assert not torch.equal(layer(xb).detach(), reference)
    detach_resize_2d(layer)
    assert layer.resize is None and torch.equal(layer(xb).detach(), reference)


def _check_impute(mesh, straggler=(0, 1)):
    """impute_value c adds c to the straggler's shares of dx[b_i*, D] and dW[D, n_j*] only."""
    inputs, c = _inputs(seed=30), 0.25
    zero, _ = _run_layer(mesh, inputs, kept={straggler: KEPT})
    filled, _ = _run_layer(mesh, inputs, kept={straggler: KEPT}, impute=c)
    dropped = complement(KEPT, K)
    dx_add = torch.zeros(B, SEQ, K, dtype=DT)
    dx_add[offsets(BATCH)[straggler[0]] : offsets(BATCH)[straggler[0]] + BATCH[straggler[0]]][
        ..., dropped
    ] = c
    dw_add = torch.zeros(K, N, dtype=DT)
    c0 = offsets(OUT)[straggler[1]]
    dw_add[dropped, c0 : c0 + OUT[straggler[1]]] = c
    # one extra addend of c in a sum of q terms: a rounding of the partial sums' magnitude
    for key, add in (
        ("dx", act(dx_add, mesh, IN)),
        ("dw", dense_block(dw_add, IN, OUT, mesh.i, mesh.j)),
    ):
        atol = 4 * unit_roundoff(DT) * float(filled[key].abs().max() + c)
        torch.testing.assert_close(filled[key] - zero[key], add, rtol=0, atol=atol, msg=key)
    for key in ("y", "db"):
        assert torch.equal(filled[key], zero[key]), key


def _check_bf16(mesh, straggler=(1, 1)):
    """bf16 against the float64 reference on the same bf16-exact inputs."""
    inputs = _inputs(torch.bfloat16, seed=40)
    got, _ = _run_layer(mesh, inputs, torch.bfloat16, kept={straggler: KEPT})
    expected, scale = _reference(mesh, inputs, {straggler: KEPT})
    for key, value in got.items():
        assert value.dtype == torch.bfloat16, key
        # per-step bf16 GEMM, the bf16 sum of q steps (or the bf16 reduce), the bias: 3 sums
        atol = chain_atol(3, max(K, N, B * SEQ), torch.bfloat16, scale[key])
        torch.testing.assert_close(value.double(), expected[key], rtol=0, atol=atol, msg=key)


def _train_step(model, x, lr=0.1, momentum=0.0):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    model(x).square().mean().backward()
    return opt


def _check_model_api(mesh, straggler=(1, 0)):
    """Priority2D scores, kept_for_slowdown identical everywhere, freezing the dropped rows."""
    heads, head_dim, ffn = (3, 1), 4, (40, 24)
    widths = tuple(a * head_dim for a in heads)
    torch.manual_seed(5)
    model = Block2D(mesh, heads, head_dim, ffn, dtype=DT)
    b0, c0 = offsets(BATCH)[mesh.i], offsets(widths)[mesh.j]
    x = randn((B, SEQ, sum(widths)), 50)[b0 : b0 + BATCH[mesh.i], :, c0 : c0 + widths[mesh.j]]
    priority = Priority2D(model)
    layers = linear_layers(model)
    before = {
        n: gather_matrix(lin.weight.detach(), mesh, lin.in_sizes, lin.out_sizes)
        for n, lin in layers.items()
    }
    _train_step(model, x).step()
    priority.refresh(model)
    scores = priority.scores(model)
    for name, layer in layers.items():  # column j: |change| summed over the outputs of column j
        after = gather_matrix(layer.weight.detach(), mesh, layer.in_sizes, layer.out_sizes)
        change = (after - before[name]).abs()
        cuts = offsets(layer.out_sizes)
        for j in range(mesh.q):
            ref = change[:, cuts[j] : cuts[j] + layer.out_sizes[j]].sum(1)
            torch.testing.assert_close(scores[name][:, j], ref, rtol=1e-12, atol=0, msg=name)
    # the magnitude rule: column j scores each entry by the norm of its row of W[:, n_j]
    norms = Priority2D(model, "magnitude").scores(model)  # collective, as scores above
    for name, layer in layers.items():
        dense = gather_matrix(layer.weight.detach(), mesh, layer.in_sizes, layer.out_sizes)
        cuts = offsets(layer.out_sizes)
        for j in range(mesh.q):
            ref = dense[:, cuts[j] : cuts[j] + layer.out_sizes[j]].double().norm(dim=1)
            torch.testing.assert_close(norms[name][:, j], ref, rtol=1e-12, atol=0, msg=name)
    kept = kept_for_slowdown(model, straggler, 1.6, scores)  # keeps 1 / 1.6 = 0.625
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {n: v.tolist() for n, v in kept.items()})
    assert all(other == everyone[0] for other in everyone)
    for name, layer in layers.items():
        total = sum(layer.in_sizes)
        assert kept[name].numel() == kept_count(total, 0.625)
        top = torch.sort(-scores[name][:, straggler[1]], stable=True).indices[: kept[name].numel()]
        assert kept[name].tolist() == sorted(top.tolist())
    attach_resize_2d(model, {straggler: kept})
    weights = {n: lin.weight.detach().clone() for n, lin in layers.items()}
    opt = _train_step(model, x, momentum=0.9)
    targets = freeze_targets_2d(model)
    with frozen_columns(opt, targets):
        opt.step()
    assert bool(targets) == (mesh.j == straggler[1])
    for name, layer in layers.items():
        own = kept[name][(kept[name] >= offsets(layer.in_sizes)[mesh.i])]
        own = own[own < offsets(layer.in_sizes)[mesh.i] + layer.in_sizes[mesh.i]]
        rows = complement(own - offsets(layer.in_sizes)[mesh.i], layer.in_sizes[mesh.i])
        moved = (layer.weight.detach() - weights[name]).abs().sum(1)
        if mesh.j == straggler[1]:
            assert not moved[rows].any(), name
            assert not opt.state[layer.weight]["momentum_buffer"][rows].any(), name
        assert moved[complement(rows, layer.in_sizes[mesh.i])].all(), name
    priority.refresh(model)  # the dropped rows keep their stale scores
    for name, layer in layers.items():
        if mesh.j == straggler[1]:
            stale = priority.trackers[name].scores
            assert stale.shape == (layer.in_sizes[mesh.i],)


def _dense_weights(layers, mesh):
    return {
        n: gather_matrix(lin.weight.detach(), mesh, lin.in_sizes, lin.out_sizes)
        for n, lin in layers.items()
    }


def _check_layer_ops(mesh, tp_rank=3):
    """The balancer's 2D actuator: a resize offload of TP index ``tp_rank`` (the rank's index
    in the TP group, ascending) lands at that rank's mesh position; refresh re-selects by the
    dense weight change of the straggler's column (stale scores on dropped rows); freezing."""
    heads, head_dim, ffn = (1, 3), 4, (16, 48)
    torch.manual_seed(6)
    model = Block2D(mesh, heads, head_dim, ffn, dtype=DT)
    layers = linear_layers(model)
    position = mesh.layout.position(sorted(mesh.layout.positions)[tp_rank])
    ops = LayerOps2D(model)
    assert ops.position(tp_rank) == position
    with pytest.raises(ValueError, match="resize only"):
        ops.apply(InLayerPlan((Offload(tp_rank, "migrate", 0.0, 0.3, 1.6),), (0, 1, 2)))
    ops.apply(InLayerPlan((Offload(tp_rank, "resize", 0.375, 0.0, 1.6),)))
    for layer in layers.values():  # fresh scores are all ones: the first entries by index
        total = sum(layer.in_sizes)
        assert list(layer.resize.kept) == [position]
        assert layer.resize.kept[position].tolist() == list(range(kept_count(total, 0.625)))
        assert (layer.resize.steps is not None) == ((mesh.i, mesh.j) == position)
    widths = tuple(a * head_dim for a in heads)
    b0, c0 = offsets(BATCH)[mesh.i], offsets(widths)[mesh.j]
    x = randn((B, SEQ, sum(widths)), 60)[b0 : b0 + BATCH[mesh.i], :, c0 : c0 + widths[mesh.j]]
    before, old = (
        _dense_weights(layers, mesh),
        {n: v.resize.kept[position] for n, v in layers.items()},
    )
    opt = _train_step(model, x, momentum=0.9)
    ops.install_freeze(opt)
    opt.step()
    ops.refresh()
    after = _dense_weights(layers, mesh)
    for name, layer in layers.items():
        cuts, j = offsets(layer.out_sizes), position[1]
        change = (after[name] - before[name]).abs()[:, cuts[j] : cuts[j] + layer.out_sizes[j]]
        dropped = complement(old[name], sum(layer.in_sizes))
        assert not change[dropped].any(), name  # frozen on every rank of the column
        scores = change.sum(1)
        scores[dropped] = 1.0  # stale: the initial score
        count = old[name].numel()
        expected = torch.sort(-scores, stable=True).indices[:count].sort().values
        assert layer.resize.kept[position].tolist() == expected.tolist(), name
    ops.clear()
    assert all(layer.resize is None for layer in layers.values()) and ops.plan.empty


def _check_errors(mesh):
    layer = Linear2D(mesh, IN, OUT, dtype=DT)
    bad = {
        "mesh position": {(2, 0): {"": KEPT}},
        "sorted": {(0, 0): {"": torch.tensor([3, 1])}},
        r"lie in \[0, 8\)": {(0, 0): {"": KEPT}, (1, 0): {"": torch.tensor([0, 8])}},
        "no Linear2D": {(0, 0): {"fc": KEPT}},
    }
    for match, kept in bad.items():
        with pytest.raises(ValueError, match=match):
            attach_resize_2d(layer, kept)
    assert layer.resize is None


def _resize_suite(rank, world_size, device):
    for placement in (None, PERMUTED):
        mesh = Mesh2D.build([[0, 1, 2, 3]], placement)
        for kept in ({(1, 0): KEPT}, {(0, 1): KEPT}, {(0, 0): KEPT, (1, 0): KEPT2}):
            _check_exact(mesh, kept)
    _check_untouched(mesh)
    _check_impute(mesh)
    _check_bf16(mesh)
    _check_errors(mesh)
    _check_model_api(mesh)
    _check_layer_ops(mesh)


@pytest.mark.dist
@pytest.mark.numerics
@pytest.mark.timeout(240)
def test_tp2d_zero_resize():
    """ZERO-resized Linear2D vs the dense reference, collectives, bf16, selection, freezing."""
    run_distributed(_resize_suite, world_size=4)
