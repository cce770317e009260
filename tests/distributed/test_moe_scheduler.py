"""ChunkedGradReducer on 2 gloo ranks (one spawn): exact gradients, the a2a gate, no hang.

A toy MoE layer, replicated on both ranks (data parallel): a dense input linear, an all-to-all
(a real ``all_to_all_single`` on its own group, in forward and backward, wrapped in the
reducer's gate), four expert linears that see only the tokens routed to them, a second
all-to-all and a dense output linear. Routing differs per rank and case: skewed (every token
to one expert) and zero (no token to any expert on rank 1), so experts get no gradient on some
rank, the case that hangs Colossal-AI's overlapped ZeRO.

Checks per case, with priority on and off:
- after ``flush`` every gradient equals a plain whole-tensor ``all_reduce`` of the same local
  gradients (a second model copy, same inputs, zero-filled where no gradient), with
  ``torch.equal``. Exact: with 2 ranks every element of either all-reduce is the single sum
  a + b of the two ranks' values (IEEE addition is commutative, so gloo's algorithm and the
  chunk's offset cannot change it), and averaging divides that same sum by the same 2;
- no chunk is launched inside an a2a's [t_launch, t_done] (priority on, windows 1 and 2), and
  at most ``max_inflight`` chunks are ever in flight;
- both ranks issued the same gradient-group sequence, chunk 0..C-1 with the planned sizes.
A direct gate check runs backward *inside* an open async a2a: with priority on every chunk
waits for the gate to close; with priority off some launch inside. A window check (gap
fitting): with a profile predicting 50 ms per chunk, a window 5 ms ahead holds every chunk
until the flush, a window 60 s ahead lets them go during backward, each with launch time plus
prediction before the window's end; gradients stay exact. Groups get a 60 s timeout so a hang
fails the test instead of stalling it.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal_hetero.moe.chunks import choose_run_chunk_bytes, plan_chunks
from colossal_hetero.moe.scheduler import ChunkedGradReducer, Event
from tests.dist_utils import run_distributed

H, T, E = 6, 8, 4
CHUNK_BYTES = 40  # 10 float32: parameters of 42 and 6 elements split into several chunks


class _A2A(torch.autograd.Function):
    """all_to_all_single forward and backward on ``group``, each inside the reducer's gate."""

    @staticmethod
    def forward(ctx, x, group, reducer):  # type: ignore[no-untyped-def]
        ctx.group, ctx.reducer = group, reducer
        return _exchange(x, group, reducer)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return _exchange(grad.contiguous(), ctx.group, ctx.reducer), None, None


def _exchange(x: torch.Tensor, group, reducer) -> torch.Tensor:
    out = torch.empty_like(x)
    if reducer is None:
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out
    with reducer.a2a(group):
        dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


class _ToyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense_in = nn.Linear(H, H)
        self.experts = nn.ModuleList(nn.Linear(H, H) for _ in range(E))
        self.dense_out = nn.Linear(H, H)

    def forward(self, x, routing, group, reducer=None):  # type: ignore[no-untyped-def]
        h = _A2A.apply(self.dense_in(x), group, reducer)
        out = h * 0.0  # keeps the graph through the a2a even when no token is routed
        for e, expert in enumerate(self.experts):
            idx = (routing == e).nonzero().flatten()
            if idx.numel():
                out = out.index_put((idx,), expert(h[idx]))
        return self.dense_out(_A2A.apply(out, group, reducer)).pow(2).sum()


def _routing(case: str, rank: int) -> torch.Tensor:
    if case == "skewed":
        return torch.full((T,), rank)  # rank 0: all to expert 0; rank 1: all to expert 1
    spread = torch.arange(T) % E
    return spread if rank == 0 else torch.full((T,), -1)  # "zero": nothing routed on rank 1


def _reference_grads(x, routing, group, a2a_group) -> list[torch.Tensor]:
    model = _ToyMoE()
    model(x, routing, a2a_group).backward()
    grads = []
    for p in model.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        grads.append(g / 2)
    return grads


def _check_log(reducer: ChunkedGradReducer, max_inflight: int | None, priority: bool) -> None:
    chunks = [e for e in reducer.events if e.kind == "chunk"]
    a2as = [e for e in reducer.events if e.kind == "a2a"]
    assert len(chunks) == len(reducer.chunks) and all(e.t_done is not None for e in chunks)
    if priority:
        for c in chunks:
            assert not any(a.t_launch <= c.t_launch <= a.t_done for a in a2as), (c, a2as)
    for c in chunks:  # in flight at c's launch: launched before, not yet observed done
        flying = sum(o.t_launch <= c.t_launch < o.t_done for o in chunks)  # type: ignore[operator]
        assert max_inflight is None or flying <= max_inflight


def _moe_cases(rank: int, group, a2a_group) -> None:
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank + 1))
    for case in ("skewed", "zero"):
        routing = _routing(case, rank)
        expected = _reference_grads(x, routing, group, a2a_group)
        # Priority on with windows of 1 and 2; off with no window: plain bucketed overlap.
        for priority, window in ((True, 1), (True, 2), (False, None)):
            model = _ToyMoE()
            reducer = ChunkedGradReducer(
                list(model.parameters()), group, CHUNK_BYTES, window, priority, average=True
            )
            model(x, routing, a2a_group, reducer).backward()
            reducer.flush()
            for p, ref in zip(model.parameters(), expected, strict=True):
                assert torch.equal(p.grad, ref), (case, priority)
            _check_log(reducer, window, priority)
            sizes = [("all_reduce", c.index, c.numel) for c in reducer.chunks]
            assert reducer.collectives == sizes
            seqs: list[object] = [None, None]
            dist.all_gather_object(seqs, reducer.collectives)
            assert seqs[0] == seqs[1]
            reducer.remove()


def _gate_check(rank: int, group, a2a_group) -> None:
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank + 7))
    for priority in (True, False):
        model = _ToyMoE()
        reducer = ChunkedGradReducer(list(model.parameters()), group, CHUNK_BYTES, None, priority)
        loss = model(x, torch.arange(T) % E, a2a_group)
        buf = torch.arange(4.0) + rank
        out = torch.empty_like(buf)
        with reducer.a2a(a2a_group) as gate:
            work = dist.all_to_all_single(out, buf, group=a2a_group, async_op=True)
            loss.backward()  # every gradient becomes ready while the a2a is in flight
            work.wait()
        reducer.flush()
        assert out.tolist() == ([0.0, 1.0, 1.0, 2.0] if rank == 0 else [2.0, 3.0, 3.0, 4.0])
        chunks: list[Event] = [e for e in reducer.events if e.kind == "chunk"]
        inside = sum(c.t_launch <= gate.t_done for c in chunks)  # type: ignore[operator]
        assert (inside == 0) if priority else (inside == len(chunks) > 0), (priority, inside)
        reducer.remove()


def _window_check(rank: int, group, a2a_group) -> None:
    import time

    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank + 3))
    routing = torch.arange(T) % E  # every expert gets tokens: every chunk ready in backward
    expected = _reference_grads(x, routing, group, a2a_group)
    for ahead, launched_in_backward in ((0.005, False), (60.0, True)):
        model = _ToyMoE()
        params = list(model.parameters())
        reducer = ChunkedGradReducer(params, group, CHUNK_BYTES, None, True, average=True)
        reducer.set_profile(0.05, 1e9)  # 50 ms per chunk, whatever its size
        loss = model(x, routing, a2a_group)  # no reducer gate: only the window acts
        reducer.window_until = time.perf_counter() + ahead
        loss.backward()
        early = [e for e in reducer.events if e.kind == "chunk"]
        assert (len(early) == len(reducer.chunks)) == launched_in_backward, (ahead, len(early))
        assert launched_in_backward or not early
        for e in early:
            assert e.deadline is not None and e.predicted is not None
            assert e.t_launch + e.predicted <= e.deadline
        reducer.flush()
        for p, ref in zip(model.parameters(), expected, strict=True):
            assert torch.equal(p.grad, ref), ahead
        reducer.remove()


class _Chain(nn.Module):
    """Three bias-free 6x6 linears registered a, b, c; rank 0 applies them b(c(a(x))), so its
    gradients arrive b, c, a (indices 1, 2, 0); rank 1 applies c(b(a(x))): 2, 1, 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b, self.c = (nn.Linear(H, H, bias=False) for _ in range(3))

    def forward(self, x, rank, gate=None):  # type: ignore[no-untyped-def]
        first, second = (self.c, self.b) if rank == 0 else (self.b, self.c)
        inner = first(self.a(x))
        return second(inner if gate is None else gate(inner)).pow(2).sum()


class _A2aInBackward(torch.autograd.Function):
    """Identity whose backward opens and closes the reducer's a2a gate, as an expert block's
    backward a2a does: the gradients after it arrive in the next phase."""

    @staticmethod
    def forward(ctx, x, reducer):  # type: ignore[no-untyped-def]
        ctx.reducer = reducer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        ctx.reducer.open_a2a()
        ctx.reducer.close_a2a()
        return grad, None


def _learn_check(rank: int, group) -> None:
    """``learn_order``: the first backward launches nothing; its flush re-plans the chunks in
    rank 0's arrival order (by hand: 24-element chunks over b, c, a of 36 each, broadcast to
    rank 1, whose own order is c, b, a; one phase, so 108 elements in five even chunks of
    22, 22, 22, 21, 21) and reduces them; the next backward launches them as they become
    ready; both steps' gradients equal a plain all-reduce. ``gated``: an a2a closes between
    the first gradient and the others on every rank, so rank 0's phases are b | c a: b alone
    in two chunks of 18, then c, a in three of 24."""
    for gated in (False, True):
        _learn_case(rank, group, gated)


def _learn_case(rank: int, group, gated: bool) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank + 5))
    model = _Chain()
    reducer = ChunkedGradReducer(list(model.parameters()), group, 96, None, False, learn_order=True)
    default = [(2, 0, 24)], [(2, 24, 36), (1, 0, 12)], [(1, 12, 36)], [(0, 0, 24)], [(0, 24, 36)]
    learnt = (
        [(1, 0, 22)],
        [(1, 22, 36), (2, 0, 8)],
        [(2, 8, 30)],
        [(2, 30, 36), (0, 0, 15)],
        [(0, 15, 36)],
    )
    if gated:
        learnt = [(1, 0, 18)], [(1, 18, 36)], [(2, 0, 24)], [(2, 24, 36), (0, 0, 12)], [(0, 12, 36)]
    gate = (lambda y: _A2aInBackward.apply(y, reducer)) if gated else None

    def layout() -> list[list[tuple[int, int, int]]]:
        return [[(s.param, s.start, s.stop) for s in c.segments] for c in reducer.chunks]

    assert layout() == list(default)
    for step in range(2):
        reference = _Chain()
        reference(x, rank).backward()
        model.zero_grad(set_to_none=True)
        model(x, rank, gate).backward()
        launched = [e for e in reducer.events if e.kind == "chunk"]
        assert len(launched) == (0 if step == 0 else 5)  # learning: nothing before the flush
        reducer.flush()
        for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
            dist.all_reduce(ref.grad, group=group)
            assert torch.equal(p.grad, ref.grad), step
        assert layout() == list(learnt)
        assert reducer.collectives == [("all_reduce", c.index, c.numel) for c in reducer.chunks]
        assert reducer.learnt_order == [1, 2, 0]  # rank 0's, broadcast
        reducer.clear_log()
    reducer.remove()


def _sized_case(rank: int, group) -> None:  # type: ignore[no-untyped-def]
    """``size_over_runs``: the default plan and the plan learnt at the first flush (the gated
    case's phases, b | c a) take ``choose_run_chunk_bytes``' size for this profile, at most the
    reducer's 96 bytes (here 6 chunks of 72 bytes after learning, where 96 makes 5); the
    gradients still equal a plain all-reduce."""
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank + 5))
    model = _Chain()
    params = list(model.parameters())
    numels, dtypes = [p.numel() for p in params], [p.dtype for p in params]
    reducer = ChunkedGradReducer(params, group, 96, None, False, learn_order=True)
    profile = (1e-6, 1e6)
    reducer.size_over_runs(*profile, 16)

    def layout() -> list[list[tuple[int, int, int]]]:
        return [[(s.param, s.start, s.stop) for s in c.segments] for c in reducer.chunks]

    def planned(order, phases):  # type: ignore[no-untyped-def]
        size = choose_run_chunk_bytes(
            numels, dtypes, *profile, order=order, phases=phases, min_bytes=16, max_bytes=96
        )
        chunks = plan_chunks(numels, dtypes, size, order, phases)
        return [[(s.param, s.start, s.stop) for s in c.segments] for c in chunks]

    assert layout() == planned(None, None)
    reference = _Chain()
    reference(x, rank).backward()
    model(x, rank, lambda y: _A2aInBackward.apply(y, reducer)).backward()
    reducer.flush()
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        dist.all_reduce(ref.grad, group=group)
        assert torch.equal(p.grad, ref.grad)
    learnt = planned([1, 2, 0], [1, 0, 1])
    assert layout() == learnt and len(learnt) == 6
    assert len(plan_chunks(numels, dtypes, 96, [1, 2, 0], [1, 0, 1])) == 5
    reducer.remove()


def _check(rank: int, world_size: int, device: torch.device) -> None:
    timeout = timedelta(seconds=60)
    group = dist.new_group([0, 1], timeout=timeout)
    a2a_group = dist.new_group([0, 1], timeout=timeout)
    _moe_cases(rank, group, a2a_group)
    _gate_check(rank, group, a2a_group)
    _window_check(rank, group, a2a_group)
    _learn_check(rank, group)
    _sized_case(rank, group)
    with pytest.raises(ValueError, match="different process group"):
        ChunkedGradReducer(list(_ToyMoE().parameters()), group, 40).a2a(group).__enter__()


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_chunked_prioritised_reduce_exact_gated_and_same_sequence():
    run_distributed(_check, world_size=2, force_cpu=True)
