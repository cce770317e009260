"""The experts' FFN node that overlaps the dispatch's backward a2a (moe/expert_ffn.py), 2 ranks.

Each rank holds two Mixtral experts; rows go to the peers' experts through the block's real
dispatch and combine a2a's (moe/block.py). Reference: the same exchange with every expert
computed by its own module in float64 (autograd). Checks, per routing case:
- outputs, the rows' gradient and every held expert's weight gradients equal the reference
  within fp32 rounding (bound below);
- an expert no row reached gets no gradient (None), as in the plain path;
- the dispatch's backward a2a was launched before any expert weight gradient was accumulated
  (the overlap: the plain path accumulates them first), and the dispatch's backward used the
  launched a2a (no extra call: both ranks logged the same four a2a calls);
- no gate is left open and nothing is left pending.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralBlockSparseTop2MLP

from colossal_hetero.moe.a2a_autograd import Combine, Dispatch
from colossal_hetero.moe.comm import MoeComm
from colossal_hetero.moe.expert_ffn import fusable, run_experts
from tests.dist_utils import run_distributed

HIDDEN, INNER = 8, 12
EPS = torch.finfo(torch.float32).eps
# Each value is a short chain of fp32 sums of at most HIDDEN + INNER products (two linears,
# SiLU, a product, a third linear, and the same back): a relative rounding of a few
# (HIDDEN + INNER) * eps of the magnitudes involved bounds it; 8x that is the margin.
TOL = 8 * (HIDDEN + INNER) * EPS

# Rows rank r sends to each (peer, that peer's held expert): [[to 0: e0, e1], [to 1: e2, e3]].
CASES = {
    "spread": [[[3, 2], [4, 1]], [[2, 5], [1, 3]]],
    "one idle expert": [[[3, 0], [2, 2]], [[4, 0], [0, 3]]],
    "nothing for rank 1": [[[3, 2], [0, 0]], [[1, 4], [0, 0]]],
}


def _experts() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INNER, hidden_act="silu")
    return torch.nn.ModuleList(MixtralBlockSparseTop2MLP(config) for _ in range(4))


def _block(rank: int, experts: torch.nn.ModuleList) -> SimpleNamespace:
    return SimpleNamespace(
        ep_group=dist.group.WORLD,
        ep_size=2,
        comm=MoeComm(fit=False),
        held=(0, 1) if rank == 0 else (2, 3),
        experts=experts,
        tp_group=None,
        pending_reverse=None,
        backward_spans=[],
        dispatch_counts=([], []),
    )


def _exchange(block, x, case, rank, fused):  # type: ignore[no-untyped-def]
    """Rows to the peers' experts and back: (output rows, piece sizes here)."""
    send = [sum(case[rank][d]) for d in range(2)]
    sizes = [case[peer][rank][j] for peer in range(2) for j in range(2)]
    recv = [sum(case[peer][rank]) for peer in range(2)]
    received = Dispatch.apply(x, send, recv, block)
    if fused:
        out = run_experts(block, received, sizes, *block.dispatch_counts)
    else:
        outputs = []
        for index, piece in enumerate(received.split(sizes)):
            if piece.shape[0]:
                expert = block.experts[block.held[index % 2]]
                outputs.append(expert.w2(expert.act_fn(expert.w1(piece)) * expert.w3(piece)))
        out = torch.cat(outputs) if outputs else received
    return Combine.apply(out, recv, send, block)


def _run(rank, case, fused, dtype):  # type: ignore[no-untyped-def]
    experts = _experts().to(dtype)
    block = _block(rank, experts)
    held = [p for e in block.held for p in experts[e].parameters()]
    stamps: list[float] = []
    for p in held:
        p.register_post_accumulate_grad_hook(lambda _: stamps.append(time.perf_counter()))
    gen = torch.Generator().manual_seed(7 + rank)
    rows = sum(sum(c) for c in case[rank])
    x = torch.randn(rows, HIDDEN, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    back = _exchange(block, x, case, rank, fused)
    (back * weight).sum().backward()
    return block, back, x.grad, [p.grad for p in held], stamps


def _close(got, want) -> None:  # type: ignore[no-untyped-def]
    assert got.dtype == torch.float32 and got.shape == want.shape
    if want.numel():
        scale = 1.0 + float(want.abs().max())
        assert float((got.double() - want).abs().max()) <= TOL * scale


def _check(rank: int, world_size: int, device: torch.device) -> None:
    assert fusable(_block(rank, _experts()))
    for name, case in CASES.items():
        block, back, dx, grads, stamps = _run(rank, case, True, torch.float32)
        _, ref_back, ref_dx, ref_grads, _ = _run(rank, case, False, torch.float64)
        _close(back, ref_back)
        _close(dx, ref_dx)
        for got, want in zip(grads, ref_grads, strict=True):
            assert (got is None) == (want is None), name
            if got is not None:
                _close(got, want)
        calls = [e for e in block.comm.events if e.kind == "a2a"]
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, len(calls))
        assert everyone == [4, 4], (name, everyone)  # dispatch and combine, each way: no extra
        reverse = calls[-1]  # the dispatch's backward a2a
        if stamps:
            assert reverse.t_launch < min(stamps), name  # launched before the weight grads
        assert block.comm._open == 0 and block.pending_reverse is None, name
        assert not block.backward_spans, name
    # The plain path accumulates the weight gradients before the dispatch's a2a: the check
    # above would fail on it.
    block, *_, stamps = _run(rank, CASES["spread"], False, torch.float32)
    calls = [e for e in block.comm.events if e.kind == "a2a"]
    assert calls[-1].t_launch > max(stamps)


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_experts_ffn_overlaps_dispatch_backward_and_matches_autograd():
    run_distributed(_check, world_size=2, force_cpu=True)
