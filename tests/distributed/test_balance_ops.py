"""Balancing ops on gloo ranks: ZERO-resizing and lossless migration, against dense references.

The 4-rank spawn (slow) runs every check (O-A1..A6, O-M1, O-M3..M5, 20 training steps).
Rank 1 is the straggler; migration helpers are ranks 3 and 0 (in that order, so the helper
order is not the rank order); rank 2 takes no part and must run the stock layer. The 2-rank
spawn (default run) repeats the core checks with rank 0 as the only helper. Widths are
uneven so that slices differ.

References: the dense single-process nn.Linear / Conv1D. For ZERO-resizing the hand reference
is the same dense layer with the straggler's dropped weight columns zeroed (its product is the
product over the kept columns alone). Tolerances: float64, see TOL.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from colossal_hetero.balance.ops import (
    attach_migration,
    attach_resize,
    complement,
    freeze_targets,
    frozen_columns,
    select_kept,
    split_migration,
)
from colossal_hetero.comm import offsets
from colossal_hetero.layers import (
    ResizableConv1DCol,
    ResizableConv1DRow,
    ResizableLinearCol,
    ResizableLinearRow,
    shard_of,
)
from colossal_hetero.plugin import prepare_device
from tests.dist_utils import run_distributed
from tests.tolerances import chain_atol, unit_roundoff

STRAGGLER = 1
# world size -> (migration helpers, column widths, row widths); the straggler's slices are
# the same size in both, the 4-rank one has a rank that takes no part (rank 2)
SETUPS = {4: ((3, 0), (2, 3, 1, 2), (2, 5, 3, 2)), 2: ((0,), (2, 3), (2, 5))}


def _helpers():
    return SETUPS[dist.get_world_size()][0]


def _col_widths():
    return SETUPS[dist.get_world_size()][1]


def _row_widths():
    return SETUPS[dist.get_world_size()][2]


IN_FEATURES, OUT_FEATURES = 8, 4
# float64: forward, backward and the all-reduce are chains of <= 3 sums of <= 24 terms (8 in
# features x 3 fused parts), each a product of N(0, 1)-ish draws below 5 in size: 24 * 25.
TOL = {"rtol": 0.0, "atol": chain_atol(3, 24, torch.float64, 24 * 25.0)}  # ~1e-12


def _randn(*shape, seed, device, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device, dtype)


def _build(kind, group, device, *, conv, num_parts=1):
    """(dense module, sharded layer, weight dim of the reduction) for kind 'col' or 'row'."""
    torch.manual_seed(0)
    k = IN_FEATURES if kind == "col" else sum(_row_widths())
    n = num_parts * sum(_col_widths()) if kind == "col" else OUT_FEATURES
    dense = (Conv1D(n, k) if conv else nn.Linear(k, n)).double().to(device)
    with torch.no_grad():
        dense.bias.normal_()
    if kind == "col":
        cls = ResizableConv1DCol if conv else ResizableLinearCol
        layer = cls.from_native_module(
            copy.deepcopy(dense), group, widths=_col_widths(), num_parts=num_parts
        )
    else:
        cls = ResizableConv1DRow if conv else ResizableLinearRow
        layer = cls.from_native_module(copy.deepcopy(dense), group, widths=_row_widths())
    return dense, layer, (0 if conv else 1)


def _run(kind, dense, layer, rank, *, num_parts=1, dtype=torch.float64):
    """Forward and backward on ``dense`` and ``layer`` with the same data.

    Returns (got, expected): dicts of y, dx, dw, db (this rank's slice of the dense ones).
    """
    for module in (dense, layer):
        module.zero_grad(set_to_none=True)
    k = IN_FEATURES if kind == "col" else sum(_row_widths())
    n = num_parts * sum(_col_widths()) if kind == "col" else OUT_FEATURES
    device = layer.weight.device
    x, dy = _randn(2, 3, k, seed=1, device=device), _randn(2, 3, n, seed=2, device=device)
    x, dy = x.to(dtype).double(), dy.to(dtype).double()  # both sides see the same inputs
    x_dense = x.clone().requires_grad_()
    y_dense = dense(x_dense)
    (y_dense * dy).sum().backward()
    conv = isinstance(layer, (ResizableConv1DCol, ResizableConv1DRow))
    if kind == "col":
        x_local, widths = x.to(dtype).requires_grad_(), _col_widths()
        dy_local = shard_of(dy, -1, widths, rank, num_parts).to(dtype)
        exp = {
            "y": shard_of(y_dense.detach(), -1, widths, rank, num_parts),
            "dx": x_dense.grad,
            "dw": shard_of(dense.weight.grad, 1 if conv else 0, widths, rank, num_parts),
            "db": shard_of(dense.bias.grad, 0, widths, rank, num_parts),
        }
    else:
        widths = _row_widths()
        x_local = shard_of(x, -1, widths, rank).to(dtype).requires_grad_()
        dy_local = dy.to(dtype)
        exp = {
            "y": y_dense.detach(),
            "dx": shard_of(x_dense.grad, -1, widths, rank),
            "dw": shard_of(dense.weight.grad, 0 if conv else 1, widths, rank),
            "db": dense.bias.grad,
        }
    y = layer(x_local)
    (y * dy_local).sum().backward()
    got = {"y": y.detach(), "dx": x_local.grad, "dw": layer.weight.grad, "db": layer.bias.grad}
    return got, exp


def _zeroed(dense, kind, wdim, dropped, num_parts=1):
    """A copy of ``dense`` whose weight entries the straggler drops are zero.

    Column-parallel: the straggler's output rows (in each fused part) at columns ``dropped``;
    row-parallel: the straggler's input columns ``dropped`` (every output row).
    """
    ref = copy.deepcopy(dense)
    weight = ref.weight.detach()
    if wdim == 0:  # Conv1D [K, N]: work on the [N, K] view
        weight = weight.t()
    with torch.no_grad():
        if kind == "col":
            total, start = sum(_col_widths()), offsets(_col_widths())[STRAGGLER]
            rows = torch.cat(
                [
                    torch.arange(_col_widths()[STRAGGLER]) + p * total + start
                    for p in range(num_parts)
                ]
            )
            block = weight[rows]
            block[:, dropped] = 0.0
            weight[rows] = block
        else:
            weight[:, dropped + offsets(_row_widths())[STRAGGLER]] = 0.0
    return ref


def _assert_all(got, exp, *, skip=(), **tol):
    for key, value in got.items():
        if key not in skip:
            torch.testing.assert_close(
                value.double(), exp[key], **(tol or TOL), msg=lambda m, key=key: f"{key}: {m}"
            )


def _straggler_width(kind):
    return IN_FEATURES if kind == "col" else _row_widths()[STRAGGLER]


RESIZE_CASES = [("col", False, 1), ("col", True, 3), ("row", False, 1), ("row", True, 1)]


def _check_resize(kind, conv, num_parts, rank, group, device):
    dense, layer, wdim = _build(kind, group, device, conv=conv, num_parts=num_parts)
    stock = _build(kind, group, device, conv=conv, num_parts=num_parts)[1]  # same seed
    width = _straggler_width(kind)
    scores = torch.rand(width, generator=torch.Generator().manual_seed(5))
    # O-A1 with fraction 1.0: the op is the stock layer, bitwise
    attach_resize(layer, STRAGGLER, select_kept(scores, 1.0), impute="zero")
    got, _ = _run(kind, dense, layer, rank, num_parts=num_parts)
    got_stock, _ = _run(kind, dense, stock, rank, num_parts=num_parts)
    for key in got:
        assert torch.equal(got[key], got_stock[key]), key
    # O-A3/A4: the kept columns' product, exact kept gradients, zero (imputed) dropped ones
    kept = select_kept(scores, 0.5)
    dropped = complement(kept, width)
    assert kept.numel() == width - width // 2 and dropped.numel() == width // 2
    attach_resize(layer, STRAGGLER, kept, impute="zero")
    got, exp = _run(
        kind, _zeroed(dense, kind, wdim, dropped, num_parts), layer, rank, num_parts=num_parts
    )
    _assert_all(got, exp, skip=("dw",))
    if rank == STRAGGLER:
        dw = got["dw"].index_select(wdim, dropped)  # Conv1D's weight is [K, N]
        assert torch.equal(dw, torch.zeros_like(dw))
        torch.testing.assert_close(
            got["dw"].index_select(wdim, kept), exp["dw"].index_select(wdim, kept), **TOL
        )
        assert not torch.equal(
            got["y" if kind == "col" else "dx"], got_stock["y" if kind == "col" else "dx"]
        )
    else:  # O-A6: other ranks run the stock local GEMM, bitwise
        _assert_all(got, exp)
        same = ("y", "dw", "db") if kind == "col" else ("dx", "dw")
        for key in same:
            assert torch.equal(got[key], got_stock[key]), key
    # O-A6: never in eval, nor under no_grad in training mode
    x = _randn(2, 3, IN_FEATURES, seed=1, device=device)
    if kind == "row":
        x = shard_of(
            _randn(2, 3, sum(_row_widths()), seed=1, device=device), -1, _row_widths(), rank
        )
    with torch.no_grad():
        y_train_nograd = layer(x)
        layer.eval()
        y_eval = layer(x)
        layer.train()
        y_stock = stock(x)
    assert torch.equal(y_eval, y_stock) and torch.equal(y_train_nograd, y_stock)


def _step(kind, dense, layer, rank, optimizer, *, freeze):
    _run(kind, dense, layer, rank)
    targets = freeze_targets([layer]) if freeze else []
    with frozen_columns(optimizer, targets):
        optimizer.step()


def _check_freeze(rank, group, device):
    """O-A5: frozen dropped columns keep param and state bitwise; unfrozen ones drift exactly
    by momentum (SGD) or by weight decay (AdamW), as computed by hand below."""
    lr, wd, momentum = 0.1, 0.1, 0.9
    kept = torch.tensor([0, 2, 3, 6])
    dropped = complement(kept, IN_FEATURES)
    for freeze in (True, False):
        dense, layer, _ = _build("col", group, device, conv=False)
        sgd = torch.optim.SGD(layer.parameters(), lr=lr, momentum=momentum, weight_decay=wd)
        _step("col", dense, layer, rank, sgd, freeze=freeze)  # step 1: every column computed
        w1 = layer.weight.detach().clone()
        buf1 = sgd.state[layer.weight]["momentum_buffer"].clone()
        attach_resize(layer, STRAGGLER, kept, impute="zero")
        _step("col", dense, layer, rank, sgd, freeze=freeze)  # step 2: resized
        w2, buf2 = layer.weight.detach(), sgd.state[layer.weight]["momentum_buffer"]
        if rank != STRAGGLER:
            continue
        assert not layer.weight.grad[:, dropped].any()  # imputed zeros
        if freeze:
            assert torch.equal(w2[:, dropped], w1[:, dropped])
            assert torch.equal(buf2[:, dropped], buf1[:, dropped])
        else:  # grad 0 + wd * w; buf = momentum * buf + grad; w -= lr * buf
            buf = momentum * buf1[:, dropped] + wd * w1[:, dropped]
            expected = w1[:, dropped] - lr * buf
            # <= 6 roundings (mul, add, mul, sub, maybe unfused), each <= u x the largest
            # magnitude involved: 8 u (max|buf| + max|w|) covers them
            scale = float(buf1.abs().max() + w1.abs().max())
            atol = 8 * unit_roundoff(torch.float64) * scale
            torch.testing.assert_close(buf2[:, dropped], buf, rtol=0.0, atol=atol)
            torch.testing.assert_close(w2[:, dropped], expected, rtol=0.0, atol=atol)
            assert (w2[:, dropped] - w1[:, dropped]).abs().min() > 0  # it did drift
        assert not torch.equal(w2[:, kept], w1[:, kept])  # the kept columns trained
    for freeze in (True, False):
        dense, layer, _ = _build("col", group, device, conv=False)
        adamw = torch.optim.AdamW(layer.parameters(), lr=lr, weight_decay=wd)
        attach_resize(layer, STRAGGLER, kept, impute="zero")
        w0 = layer.weight.detach().clone()
        _step("col", dense, layer, rank, adamw, freeze=freeze)
        if rank != STRAGGLER:
            continue
        state = adamw.state[layer.weight]
        for key in ("exp_avg", "exp_avg_sq"):  # zero gradient, zero moments
            assert not state[key][:, dropped].any()
        w_d = layer.weight.detach()[:, dropped]
        if freeze:
            assert torch.equal(w_d, w0[:, dropped])
        else:  # decoupled decay w *= 1 - lr wd, then an update 0 / (sqrt(0) + eps) = 0
            # one multiply and one add of 0 in float64: 2 u relative
            atol = 2 * unit_roundoff(torch.float64) * float(w0.abs().max())
            expected = w0[:, dropped] * (1 - lr * wd)
            torch.testing.assert_close(w_d, expected, rtol=0.0, atol=atol)


def _check_bf16(rank, group, device):
    """ZERO-resizing in bfloat16 against the float64 kept-column reference (same bf16 inputs)."""
    kept = torch.tensor([1, 2, 5, 7])
    dropped = complement(kept, IN_FEATURES)
    dense, layer, wdim = _build("col", group, device, conv=False)
    layer = layer.to(torch.bfloat16)
    with torch.no_grad():  # the reference sees the same (bf16-rounded) weights
        dense.weight.copy_(dense.weight.bfloat16().double())
        dense.bias.copy_(dense.bias.bfloat16().double())
    attach_resize(layer, STRAGGLER, kept, impute="zero")
    ref = _zeroed(dense, "col", wdim, dropped)
    got, exp = _run("col", ref, layer, rank, dtype=torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    x = _randn(2, 3, IN_FEATURES, seed=1, device=device).bfloat16().double()
    dy = _randn(2, 3, sum(_col_widths()), seed=2, device=device).bfloat16().double()
    w = ref.weight.detach()
    # sum|terms| of each result (the dense sums; the straggler's are subsets of them)
    scale = {
        "y": float((x.abs() @ w.abs().t() + ref.bias.detach().abs()).max()),
        "dx": float((dy.abs() @ w.abs()).max()),
        "dw": float((dy.flatten(0, 1).abs().t() @ x.flatten(0, 1).abs()).max()),
    }
    scale["db"] = float(dy.flatten(0, 1).abs().sum(0).max())
    # exact bf16 inputs; y, dw, db: one sum of <= 8 terms; dx: a local sum then the bf16
    # all-reduce over 4 ranks: two chained sums, each within sum|terms| <= scale
    atol = {key: chain_atol(2, 8, torch.bfloat16, value) for key, value in scale.items()}
    for key in ("y", "dx", "db"):
        torch.testing.assert_close(got[key].double(), exp[key], rtol=0.0, atol=atol[key])
    if rank == STRAGGLER:
        assert not got["dw"][:, dropped].any()  # imputed zeros
        torch.testing.assert_close(
            got["dw"][:, kept].double(), exp["dw"][:, kept], rtol=0.0, atol=atol["dw"]
        )
        stock_y = shard_of(dense(x).detach(), -1, _col_widths(), rank)
        assert (stock_y - exp["y"]).abs().max() > 2 * atol["y"]  # the bound tells them apart


def _expected_bytes(kind, split, num_parts, rank):
    """Bytes ``rank`` sends per forward + backward (migrate.py's formula), float64."""
    batch, e = 6, 8
    rows = num_parts * _col_widths()[STRAGGLER] if kind == "col" else OUT_FEATURES
    total = 0
    for helper, cols in zip(_helpers(), split.migrated, strict=True):
        m = cols.numel()
        if m == 0 or rank not in (helper, STRAGGLER):
            continue
        if kind == "col":  # r: W[:, M_h], dy_r; h: partial y_r, dW[:, M_h]
            total += rows * m + batch * rows
        else:  # r: W[:, M_h], x_r[..., M_h]; h: dx_r[..., M_h], dW[:, M_h]
            total += rows * m + batch * m
    return total * e


def _count_all_reduce(fn):
    """Run ``fn`` counting dist.all_reduce calls (the layers call it through the module)."""
    calls, original = [], dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        out = fn()
    finally:
        dist.all_reduce = original
    return out, len(calls)


def _check_migration(kind, conv, num_parts, fraction, drop, rank, group, device):
    """O-M1 (lossless), O-M3 (one SGD step as dense), O-M4 (bytes), O-M5 (no extra all-reduce)."""
    dense, layer, wdim = _build(kind, group, device, conv=conv, num_parts=num_parts)
    stock = _build(kind, group, device, conv=conv, num_parts=num_parts)[1]  # same seed
    width = _straggler_width(kind)
    scores = torch.rand(width, generator=torch.Generator().manual_seed(7))
    split = split_migration(scores, round(fraction * width), len(_helpers()), drop)
    op = attach_migration(layer, STRAGGLER, _helpers(), split)
    ref = _zeroed(dense, kind, wdim, split.dropped, num_parts) if drop else dense
    (got, exp), calls = _count_all_reduce(lambda: _run(kind, ref, layer, rank, num_parts=num_parts))
    _, stock_calls = _count_all_reduce(lambda: _run(kind, ref, stock, rank, num_parts=num_parts))
    assert calls == stock_calls, (calls, stock_calls)
    _assert_all(got, exp, skip=("dw",) if drop else ())
    if drop and rank == STRAGGLER:
        assert not got["dw"].index_select(wdim, split.dropped).any()
        keep = complement(split.dropped, width)
        torch.testing.assert_close(
            got["dw"].index_select(wdim, keep), exp["dw"].index_select(wdim, keep), **TOL
        )
    elif drop:
        torch.testing.assert_close(got["dw"], exp["dw"], **TOL)
    assert op.bytes_sent == _expected_bytes(kind, split, num_parts, rank), op.bytes_sent
    total = torch.tensor([op.bytes_sent])
    dist.all_reduce(total, group=group)
    hand = sum(_expected_bytes(kind, split, num_parts, r) for r in range(dist.get_world_size()))
    assert int(total) == hand
    if drop == 0:  # O-M3: the owner steps its own shard; the result is the dense step's slice
        for module in (layer, ref):
            torch.optim.SGD(module.parameters(), lr=0.1).step()
        shard_dim = (1 - wdim) if kind == "col" else wdim
        widths = _col_widths() if kind == "col" else _row_widths()
        parts = num_parts if kind == "col" else 1
        expected = shard_of(ref.weight.detach(), shard_dim, widths, rank, parts)
        torch.testing.assert_close(layer.weight.detach(), expected, **TOL)


MIGRATION_CASES = [
    *[("col", False, 1, f, 0) for f in (1 / 8, 1 / 2, 7 / 8)],
    *[("row", False, 1, f, 0) for f in (1 / 8, 1 / 2, 7 / 8)],
    ("col", True, 3, 1 / 2, 0),  # fused QKV Conv1D
    ("row", True, 1, 1 / 2, 0),  # Conv1D
    ("col", False, 1, 1 / 2, 2),  # migrate + resize
    ("row", False, 1, 1 / 2, 1),
]


def _check_training(rank, group, device):
    """20 fp32 SGD steps of col -> tanh -> row with both layers migrated match dense training."""
    widths, helpers = _col_widths(), _helpers()
    torch.manual_seed(0)
    dense = nn.Sequential(
        nn.Linear(IN_FEATURES, sum(widths)), nn.Tanh(), nn.Linear(sum(widths), OUT_FEATURES)
    ).to(device)
    col = ResizableLinearCol.from_native_module(copy.deepcopy(dense[0]), group, widths=widths)
    row = ResizableLinearRow.from_native_module(copy.deepcopy(dense[2]), group, widths=widths)
    gen = torch.Generator().manual_seed(11)
    for layer, width in ((col, IN_FEATURES), (row, widths[STRAGGLER])):
        split = split_migration(torch.rand(width, generator=gen), width // 2 + 1, len(helpers))
        attach_migration(layer, STRAGGLER, helpers, split)
    tp = nn.Sequential(col, nn.Tanh(), row)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (dense, tp)]
    # the whole run as one chain: 20 steps x (3 forward + 3 backward reductions) of <= 8
    # terms, every magnitude (outputs, loss, weights, gradients) below 4 in these draws
    tol = {"rtol": 0.0, "atol": chain_atol(20 * 6, 8, torch.float32, 4.0)}  # ~4e-4
    for step in range(20):
        x = _randn(4, IN_FEATURES, seed=100 + step, device=device, dtype=torch.float32)
        target = _randn(4, OUT_FEATURES, seed=200 + step, device=device, dtype=torch.float32)
        losses = []
        for model, optimizer in zip((dense, tp), optimizers, strict=True):
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], **tol)
        assert float(losses[0]) < 4.0  # the magnitude the tolerance assumes
    assert max(float(p.detach().abs().max()) for p in dense.parameters()) < 4.0
    expected_col = shard_of(dense[0].weight.detach(), 0, widths, rank)
    torch.testing.assert_close(col.weight.detach(), expected_col, **tol)
    torch.testing.assert_close(
        row.weight.detach(), shard_of(dense[2].weight.detach(), 1, widths, rank), **tol
    )
    assert (
        col.local_op.bytes_sent > 0
        if rank in (STRAGGLER, *helpers)
        else col.local_op.bytes_sent == 0
    )


def _all_checks(rank, world_size, device):
    prepare_device(device)
    group = dist.new_group(list(range(world_size)))
    for kind, conv, num_parts in RESIZE_CASES:
        _check_resize(kind, conv, num_parts, rank, group, device)
    _check_freeze(rank, group, device)
    _check_bf16(rank, group, device)
    for case in MIGRATION_CASES:
        _check_migration(*case, rank, group, device)
    _check_training(rank, group, device)


def _fast_checks(rank, world_size, device):
    prepare_device(device)
    group = dist.new_group(list(range(world_size)))
    _check_resize("col", False, 1, rank, group, device)
    _check_resize("row", False, 1, rank, group, device)
    _check_migration("col", True, 3, 1 / 2, 0, rank, group, device)
    _check_migration("row", False, 1, 1 / 2, 1, rank, group, device)
    _check_training(rank, group, device)


def test_balance_ops_two_ranks():
    """The core checks on 2 ranks (straggler 1, helper 0), in the default test run."""
    run_distributed(_fast_checks, 2)


@pytest.mark.slow  # 4 processes importing colossalai on 2 shared cores: ~2 min measured (35 s CPU)
def test_balance_ops_four_ranks():
    run_distributed(_all_checks, 4)
