"""Uneven collectives against a dense single-process reference, forward and backward.

Every rank builds the same random tensors (one seed), so each rank can compute the dense
reference of the whole collective locally: what the gathered tensor, the summed shards and
every rank's gradient must be. Each collective runs with both methods ("padded", "grouped"),
which must agree with the reference and with each other (oracles O-C1..O-C4 of the digest:
gather == cat, its backward == reduce-scatter of the grads, reduce-scatter == sum split by
widths, zero-width shards and size-1 dims work).

Tolerances: float64 data; gathers, slices and all-to-all move values exactly; sums over
ranks may differ from the reference only in summation order (sum_order_atol, ~1.6e-14).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colossal_hetero.comm import (
    METHODS,
    all_gather_uneven,
    all_reduce,
    all_to_all_uneven,
    copy_to_group,
    offsets,
    reduce_scatter_uneven,
    split_uneven,
)
from tests.dist_utils import run_distributed
from tests.tolerances import sum_order_atol

# float64 sums over <= 4 ranks of N(0, 1) draws (|x| < 6 in these seeded draws), in another order.
TOL = {"rtol": 0.0, "atol": sum_order_atol(4, torch.float64, 4 * 6.0)}  # ~1.6e-14


def _randn(shape, seed, device):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(device)


def _full(shape, dim, total, seed, device):
    shape = list(shape)
    shape[dim] = total
    return _randn(shape, seed, device)


def _slice(x, dim, widths, rank):
    return x.narrow(dim, offsets(widths)[rank], widths[rank])


def _cases(num_ranks: int, seed: int = 0):
    """(shape, dim, widths): fixed edge cases plus random widths that include zeros."""
    generator = torch.Generator().manual_seed(seed)
    cases = [
        ((3, 0, 2), 1, (0,) * num_ranks),  # every shard empty
        ((1, 0, 1), 1, (1,) + (0,) * (num_ranks - 1)),  # size-1 dims, one non-empty shard
        ((0, 4), 1, (2,) * num_ranks),  # empty in another dim
        ((2, 0), -1, tuple(range(num_ranks))),  # rank 0 empty
        ((0, 3, 1), 0, tuple(range(num_ranks, 0, -1))),  # last dims size 1, dim 0
    ]
    for _ in range(6):
        widths = tuple(int(w) for w in torch.randint(0, 5, (num_ranks,), generator=generator))
        dim = int(torch.randint(0, 3, (1,), generator=generator))
        cases.append(((2, 3, 2), dim, widths))
    return cases


def _check_all_gather(rank, ranks, group, device, shape, dim, widths):
    full = _full(shape, dim, sum(widths), 1, device)
    upstream = [_full(shape, dim, sum(widths), 100 + r, device) for r in range(len(ranks))]
    grads = {}
    for method in METHODS:
        for reduce_grads in (False, True):
            x = _slice(full, dim, widths, rank).clone().requires_grad_()
            out = all_gather_uneven(
                x, dim, widths, group=group, method=method, reduce_grads=reduce_grads
            )
            torch.testing.assert_close(out, full, rtol=0, atol=0)
            # Replicated consumer (same grad everywhere) vs per-rank consumers (summed).
            grad_out = upstream[rank] if reduce_grads else upstream[0]
            (out * grad_out).sum().backward()
            expected = sum(upstream) if reduce_grads else upstream[0]
            torch.testing.assert_close(x.grad, _slice(expected, dim, widths, rank), **TOL)
            grads[method, reduce_grads] = x.grad
    for reduce_grads in (False, True):
        torch.testing.assert_close(
            grads["padded", reduce_grads], grads["grouped", reduce_grads], **TOL
        )


def _check_reduce_scatter(rank, ranks, group, device, shape, dim, widths):
    inputs = [_full(shape, dim, sum(widths), 10 + r, device) for r in range(len(ranks))]
    upstream = _full(shape, dim, sum(widths), 7, device)
    outs = {}
    for method in METHODS:
        x = inputs[rank].clone().requires_grad_()
        out = reduce_scatter_uneven(x, dim, widths, group=group, method=method)
        torch.testing.assert_close(out, _slice(sum(inputs), dim, widths, rank), **TOL)
        (out * _slice(upstream, dim, widths, rank)).sum().backward()
        torch.testing.assert_close(x.grad, upstream, rtol=0, atol=0)
        outs[method] = out
    torch.testing.assert_close(outs["padded"], outs["grouped"], **TOL)


def _check_split(rank, ranks, group, device, shape, dim, widths):
    full = _full(shape, dim, sum(widths), 3, device)
    upstream = _full(shape, dim, sum(widths), 4, device)
    for method in METHODS:
        x = full.clone().requires_grad_()
        out = split_uneven(x, dim, widths, group=group, method=method)
        torch.testing.assert_close(out, _slice(full, dim, widths, rank), rtol=0, atol=0)
        (out * _slice(upstream, dim, widths, rank)).sum().backward()
        torch.testing.assert_close(x.grad, upstream, rtol=0, atol=0)


def _check_all_reduce_pair(rank, ranks, group, device, shape):
    inputs = [_randn(shape, 20 + r, device) for r in range(len(ranks))]
    x = inputs[rank].clone().requires_grad_()
    out = all_reduce(x, group=group)
    torch.testing.assert_close(out, sum(inputs), **TOL)
    (out * inputs[0]).sum().backward()  # identity backward: the replicated upstream grad
    torch.testing.assert_close(x.grad, inputs[0], rtol=0, atol=0)

    y = inputs[0].clone().requires_grad_()
    out = copy_to_group(y, group=group)
    torch.testing.assert_close(out, inputs[0], rtol=0, atol=0)
    (out * inputs[rank]).sum().backward()  # per-rank upstream grads are summed
    torch.testing.assert_close(y.grad, sum(inputs), **TOL)


def _check_all_to_all(rank, ranks, group, device, split_widths, cat_widths, split_dim, cat_dim):
    shape = [2, 3, 2]
    shape[split_dim], shape[cat_dim] = sum(split_widths), sum(cat_widths)
    dense, upstream = _randn(shape, 5, device), _randn(shape, 6, device)
    outs = {}
    for method in METHODS:
        x = _slice(dense, cat_dim, cat_widths, rank).clone().requires_grad_()
        out = all_to_all_uneven(
            x,
            split_dim=split_dim,
            cat_dim=cat_dim,
            split_widths=split_widths,
            cat_widths=cat_widths,
            group=group,
            method=method,
        )
        torch.testing.assert_close(
            out, _slice(dense, split_dim, split_widths, rank), rtol=0, atol=0
        )
        (out * _slice(upstream, split_dim, split_widths, rank)).sum().backward()
        torch.testing.assert_close(
            x.grad, _slice(upstream, cat_dim, cat_widths, rank), rtol=0, atol=0
        )
        outs[method] = (out, x.grad)
    torch.testing.assert_close(outs["padded"], outs["grouped"], rtol=0, atol=0)


def _check_all(rank, ranks, group, device, seed):
    cases = _cases(len(ranks), seed)
    for shape, dim, widths in cases:
        _check_all_gather(rank, ranks, group, device, shape, dim, widths)
        _check_reduce_scatter(rank, ranks, group, device, shape, dim, widths)
        _check_split(rank, ranks, group, device, shape, dim, widths)
    for shape in ((3, 1, 2), (1,), (0, 2)):
        _check_all_reduce_pair(rank, ranks, group, device, shape)
    generator = torch.Generator().manual_seed(seed + 1)
    for split_dim, cat_dim in ((0, 1), (2, 0), (1, 2)):
        for _ in range(2):
            split_widths, cat_widths = torch.randint(
                0, 4, (2, len(ranks)), generator=generator
            ).tolist()
            _check_all_to_all(
                rank, ranks, group, device, split_widths, cat_widths, split_dim, cat_dim
            )
    _check_all_to_all(rank, ranks, group, device, [0] * len(ranks), [1] * len(ranks), 0, 1)


def _check_errors(group, device):
    x = torch.zeros(2, 3, device=device)
    with pytest.raises(ValueError, match="one width per rank"):
        all_gather_uneven(x, 0, (2,), group=group)
    with pytest.raises(ValueError, match="group is required"):
        all_gather_uneven(x, 0, (2, 0), group=None)
    with pytest.raises(ValueError, match="method"):
        all_gather_uneven(x, 0, (2, 0), group=group, method="ring")
    with pytest.raises(ValueError, match=">= 0"):
        reduce_scatter_uneven(x, 0, (3, -1), group=group)


def _two_ranks(rank, world_size, device):
    group = dist.group.WORLD
    _check_all(rank, list(range(world_size)), group, device, seed=0)
    _check_errors(group, device)


def _three_ranks(rank, world_size, device):
    _check_all(rank, list(range(world_size)), dist.group.WORLD, device, seed=1)
    # A subgroup whose ranks differ from global ranks: broadcast/reduce roots must be mapped.
    sub = dist.new_group([0, 2])
    if rank != 1:
        _check_all([0, 2].index(rank), [0, 2], sub, device, seed=2)
    dist.barrier()


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_uneven_collectives_two_ranks():
    run_distributed(_two_ranks, world_size=2)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_uneven_collectives_three_ranks_and_subgroup():
    run_distributed(_three_ranks, world_size=3)
