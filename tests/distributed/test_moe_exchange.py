"""The exchange node that computes a rank's own rows while the a2a's are on the wire
(moe/exchange.py), 2 ranks.

Same setting as test_moe_expert_ffn.py (two Mixtral experts per rank, the real a2a's);
reference: the exchange through the block's separate nodes with every expert computed by
its own module in float64 (autograd). Per routing case, with the routing counts exchanged
first and folded into the dispatch (with capacities below the rows, so the overflow rows go
point to point):
- outputs, the rows' gradient and every held expert's weight gradients equal the reference
  within fp32 rounding; an expert no row reached gets no gradient (None);
- bitwise equal to the fused node of moe/expert_ffn.py (the same arithmetic);
- the order of work: forward, the own rows' pieces are computed after the dispatch a2a was
  launched and before it was waited, the peers' rows after; backward, the own rows' input
  gradients before the combine's reverse a2a was waited, and the peers' rows' weight
  gradients after the dispatch's reverse a2a was launched and before it was waited;
- both ranks issue the same a2a calls (four, or five with the counts a2a ahead of them), no
  gate is left open.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from colossal_hetero.moe import exchange
from colossal_hetero.moe.comm import MoeComm
from colossal_hetero.moe.exchange import Route, held_exchange
from colossal_hetero.moe.folded import PairHistory
from tests.dist_utils import run_distributed
from tests.distributed.test_moe_expert_ffn import CASES, HIDDEN, _block, _close, _experts, _run


def _route(case, rank: int, folded: bool, block) -> Route:  # type: ignore[no-untyped-def]
    counts = torch.tensor([n for d in range(2) for n in case[rank][d]])
    send = [sum(case[rank][d]) for d in range(2)]
    recv = [sum(case[peer][rank]) for peer in range(2)]
    if not folded:
        peer = torch.tensor([n for p in range(2) for n in case[p][rank]])
        return Route(counts, send, peer, None)
    history = PairHistory(2)
    history.record([max(0, n - 2) for n in send], [max(0, n - 2) for n in recv])
    return Route(counts, send, None, history)


def _block_for(rank: int, experts, log: list) -> object:  # type: ignore[no-untyped-def]
    block = _block(rank, experts)
    block.ep_rank = rank
    block.device_sizes = [2, 2]
    block.comm = MoeComm(fit=False)
    block.mark_idle = lambda reached, learning=None: log.append(("idle", tuple(reached)))
    return block


@contextmanager
def _traced(log: list) -> Iterator[None]:
    """Log the node's launches, waits and piece computations in the order they happen."""
    names = {
        "_launch_dispatch": "launch dispatch",
        "_finish_dispatch": "wait dispatch",
        "_run_pieces": "forward pieces",
        "_piece_grads": "input grad",
        "_weight_parts": "weight grad",
        "launch": "launch",
    }
    saved = {name: getattr(exchange, name) for name in names}

    def traced(name: str):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            log.append((names[name], _detail(name, args)))
            out = saved[name](*args, **kwargs)
            if name == "launch":  # log its wait too
                wait = out.wait
                out.wait = lambda: (log.append(("wait", 0)), wait())[1]
            return out

        return call

    try:
        for name in names:
            setattr(exchange, name, traced(name))
        yield
    finally:
        for name, original in saved.items():
            setattr(exchange, name, original)


def _detail(name: str, args: tuple) -> int:
    """Rows of a forward's pieces; the piece index of a gradient computation."""
    if name == "_run_pieces":
        return int(args[0].shape[0])
    if name in ("_piece_grads", "_weight_parts"):
        return int(args[2])
    return 0


def _run_node(rank: int, case, folded: bool, log: list):  # type: ignore[no-untyped-def]
    experts = _experts()
    block = _block_for(rank, experts, log)
    held = [p for e in block.held for p in experts[e].parameters()]
    gen = torch.Generator().manual_seed(7 + rank)  # the rows and weights of test_moe_expert_ffn
    rows = sum(sum(c) for c in case[rank])
    x = torch.randn(rows, HIDDEN, generator=gen).requires_grad_()
    weight = torch.randn(rows, HIDDEN, generator=gen)
    with _traced(log):
        back = held_exchange(block, x, _route(case, rank, folded, block))
        (back * weight).sum().backward()
    return back, x.grad, [p.grad for p in held], block


def _check_order(log: list, rank: int) -> None:
    """The order of work (see the module); piece ``i`` is from source ``i // 2``."""
    at = {label: [n for n, (lab, _) in enumerate(log) if lab == label] for label, _ in log}
    pieces = at["forward pieces"]
    assert at["launch dispatch"][0] < pieces[0] < at["wait dispatch"][0] < pieces[1]
    # The last three: the combine, its reverse, the dispatch's reverse (unfolded, the dispatch
    # itself is the first of four).
    launches, waits = at["launch"][-3:], at["wait"][-3:]
    assert len(at["launch"]) == len(at["wait"]) in (3, 4) and len(launches) == 3
    own = [n for n, (lab, i) in enumerate(log) if lab == "input grad" and i // 2 == rank]
    assert all(launches[1] < n < waits[1] for n in own), log
    peer = [n for n, (lab, i) in enumerate(log) if lab == "weight grad" and i // 2 != rank]
    assert all(launches[2] < n < waits[2] for n in peer), log


def _check(rank: int, world_size: int, device: torch.device) -> None:
    for name, case in CASES.items():
        _, ref_back, ref_dx, ref_grads, _ = _run(rank, case, False, torch.float64)
        _, ffn_back, ffn_dx, ffn_grads, _ = _run(rank, case, True, torch.float32)
        reached = tuple(sum(case[p][rank][j] for p in range(2)) for j in range(2))
        for folded in (False, True):
            log: list = []
            back, dx, grads, block = _run_node(rank, case, folded, log)
            _close(back, ref_back)
            _close(dx, ref_dx)
            assert torch.equal(back, ffn_back) and torch.equal(dx, ffn_dx), (name, folded)
            for got, want, fused in zip(grads, ref_grads, ffn_grads, strict=True):
                assert (got is None) == (want is None), (name, folded)
                if got is not None:
                    _close(got, want)
                    assert torch.equal(got, fused), (name, folded)
            assert ("idle", reached) in log, (name, folded)
            _check_order(log, rank)
            calls = sum(1 for e in block.comm.events if e.kind == "a2a")
            everyone: list = [None] * world_size
            dist.all_gather_object(everyone, calls)
            assert everyone == [4, 4], (name, folded, everyone)
            assert block.comm._open == 0, (name, folded)


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_exchange_overlaps_own_rows_and_matches_autograd():
    run_distributed(_check, world_size=2, force_cpu=True)
