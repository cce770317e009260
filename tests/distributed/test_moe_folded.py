"""The routing counts folded into the dispatch a2a (moe/folded.py), on 2 gloo ranks.

Reference: the unfolded exchange written out by hand (an a2a of the counts, then the rows
with the exact sizes). The folded dispatch must hand every rank the same rows and counts,
bit for bit, whether the rows fit the pairs' capacities or overflow them (point to point,
including a rank's rows to itself), and both ranks must issue the same a2a's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from colossal_hetero.moe.comm import MoeComm
from colossal_hetero.moe.folded import PairHistory, capacity, folded_dispatch, header_fits
from tests.dist_utils import run_distributed

HIDDEN = 8
SIZES = [2, 2]  # experts per ep rank


def _reference(rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    peer = torch.empty(4, dtype=torch.long)
    dist.all_to_all_single(peer, counts, [2, 2], SIZES)
    send = [int(c.sum()) for c in counts.split(SIZES)]
    recv = peer.view(2, 2).sum(dim=1).tolist()
    out = rows.new_empty(sum(recv), HIDDEN)
    dist.all_to_all_single(out, rows, recv, send)
    return out, peer


def _case(rank: int, per_expert: list[list[int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.tensor(per_expert[rank], dtype=torch.long)
    gen = torch.Generator().manual_seed(seed + rank)
    rows = torch.randn(int(counts.sum()), HIDDEN, generator=gen).to(torch.bfloat16)
    return rows, counts


@contextmanager
def _logged(comm: MoeComm) -> Iterator[list[int]]:
    calls: list[int] = []
    yield calls
    calls.extend(e.nbytes for e in comm.events if e.kind == "a2a")


def _check(rank: int, world_size: int, device: torch.device) -> None:
    comm = MoeComm(fit=False)
    block = SimpleNamespace(
        ep_size=2,
        ep_rank=rank,
        held=(0, 1) if rank == 0 else (2, 3),
        device_sizes=SIZES,
        comm=comm,
        ep_group=dist.group.WORLD,
    )
    assert header_fits(HIDDEN * 2, SIZES)
    history = PairHistory(2)
    history.record([10, 10], [10, 10])  # capacity ceil(1.1 * 10) + 8 = 19 rows per pair
    assert capacity([10]) == 19
    cases = [
        [[3, 4, 5, 6], [7, 0, 2, 9]],  # every pair fits
        [[20, 5, 0, 30], [1, 25, 3, 3]],  # rank 0 -> self 25 and -> rank 1 30 overflow
        [[0, 0, 0, 0], [0, 0, 0, 0]],  # nothing to send
    ]
    for index, per_expert in enumerate(cases):
        rows, counts = _case(rank, per_expert, seed=10 * index)
        want_rows, want_counts = _reference(rows, counts)
        with _logged(comm) as calls:
            got_rows, got_counts, send, recv = folded_dispatch(block, rows, counts, history)
        assert torch.equal(got_counts, want_counts), (index, got_counts, want_counts)
        assert got_rows.dtype == rows.dtype and torch.equal(got_rows, want_rows), index
        assert send == [int(c.sum()) for c in counts.split(SIZES)]
        assert recv == want_counts.view(2, 2).sum(dim=1).tolist()
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, len(calls))
        assert everyone == [1, 1], (index, everyone)  # one a2a, overflow or not
        comm.clear()


@pytest.mark.timeout(120)
def test_folded_dispatch_equals_counts_then_rows() -> None:
    run_distributed(_check, 2, force_cpu=True)
