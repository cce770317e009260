"""A layer's dispatch a2a, held experts and combine a2a as one autograd node, with the rows a
rank routes to its own experts computed while the a2a's are on the wire.

Of the rows a rank dispatches, those for its own experts do not need the network: they are
in its dispatch tensor before the a2a starts, and the a2a only copies them. The node
:class:`HeldExchange` therefore, in forward:

1. launches the dispatch a2a asynchronously (folded or not, moe/folded.py);
2. computes its held experts on its own rows while the peers' rows are on the wire;
3. waits, computes the held experts on the peers' rows;
4. sends every output back (the combine a2a) and waits for its rows' outputs.

In backward, the mirror image: it launches the combine's reverse a2a, computes its own rows'
input and weight gradients while the output gradients of the peers' rows travel, then the
peers' rows' input gradients; it launches the dispatch's reverse a2a and computes the peers'
rows' weight gradients while that one travels (as :mod:`.expert_ffn` does).

Same arithmetic as the block's path through :class:`.expert_ffn.ExpertsFFN`: every piece
(rows of one source rank for one held expert) goes through the same functions, and an
expert's weight gradient is the sum of its pieces' parts in the same order (source rank by
source rank), so outputs and gradients are bitwise those of that path. The a2a sequence is
the same too (every rank issues the same calls whatever the routing), each inside the
reducers' gate (priority: no gradient chunk is launched while one is on the wire), and the
whole backward is one pending span, as the combine's and dispatch's nodes open and close it.

Used for the fused path only (:func:`.expert_ffn.fusable`: Hugging Face Mixtral experts, no
tensor parallelism), without packing or a2a/expert pipelining (their own exchanges).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from colossal_hetero.moe.expert_ffn import (
    PendingA2a,
    launch,
    piece_forward,
    piece_input_grad,
)
from colossal_hetero.moe.folded import FoldedLaunch, finish_folded, launch_folded


@dataclass
class Route:
    """One forward's routing as the block computed it.

    ``counts``: rows per expert slot (all experts, slot order: ``device_sizes`` per rank);
    ``send``: rows to each ep rank; ``peer_counts``: rows per (source rank, held expert) when
    already exchanged (the unfolded path's counts a2a), None when the dispatch carries them
    (folded); ``history``: the block's per-pair counts (folded, or to record); ``learning``:
    whether the forward trains (grad mode is off inside the node's forward)."""

    counts: torch.Tensor
    send: list[int]
    peer_counts: torch.Tensor | None
    history: Any
    learning: bool = True
    """A training forward with gradients on (idle experts are marked: ``block.mark_idle``)."""


def _weights(block: Any) -> list[torch.Tensor]:
    return [
        layer.weight
        for e in block.held
        for layer in (block.experts[e].w1, block.experts[e].w3, block.experts[e].w2)
    ]


def held_exchange(block: Any, dispatch: torch.Tensor, route: Route) -> torch.Tensor:
    """Each row of ``dispatch`` (sorted by destination slot) through its expert, wherever it
    is held, back in ``dispatch``'s order (:class:`HeldExchange`). Collective on the block's
    ep group: the dispatch a2a and the combine a2a, and their reverses in backward."""
    return HeldExchange.apply(dispatch, route, block, *_weights(block))


def _own_rows(block: Any, dispatch: torch.Tensor, route: Route) -> tuple[torch.Tensor, list[int]]:
    """The rows this rank sends itself and their sizes per held expert (held order)."""
    me = block.ep_rank
    start = sum(route.send[:me])
    first = sum(block.device_sizes[:me])
    sizes = route.counts[first : first + len(block.held)].tolist()
    return dispatch[start : start + route.send[me]], [int(n) for n in sizes]


def _run_pieces(
    rows: torch.Tensor, sizes: Sequence[int], weights: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, ...] | None]:
    """Per held expert ``j``, ``piece_forward`` of its ``sizes[j]`` rows (None: no rows)."""
    out: list[tuple[torch.Tensor, ...] | None] = []
    for j, piece in enumerate(rows.split(list(sizes))):
        out.append(piece_forward(piece, *weights[3 * j : 3 * j + 3]) if piece.shape[0] else None)
    return out


def _launch_dispatch(block: Any, dispatch: torch.Tensor, route: Route) -> PendingA2a | FoldedLaunch:
    if route.peer_counts is None:
        return launch_folded(block, dispatch, route.counts, route.history)
    return launch(dispatch, route.send, _exchanged_recv(route, block), block)


def _exchanged_recv(route: Route, block: Any) -> list[int]:
    """Rows each ep rank sends this one, from the counts exchanged before the dispatch."""
    assert route.peer_counts is not None
    return route.peer_counts.view(block.ep_size, len(block.held)).sum(dim=1).tolist()


def _finish_dispatch(
    pending: PendingA2a | FoldedLaunch, route: Route, block: Any
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """(received, peer counts, send, recv) of the launched dispatch."""
    if isinstance(pending, FoldedLaunch):
        return finish_folded(pending)
    assert route.peer_counts is not None
    return pending.wait(), route.peer_counts, route.send, _exchanged_recv(route, block)


@dataclass
class _Pieces:
    """Where each (source rank, held expert) piece of the received rows lies."""

    sizes: list[int]  # rows per piece, source-major (``peer counts``)
    local: int  # held experts

    def starts(self) -> list[int]:
        out, at = [], 0
        for n in self.sizes:
            out.append(at)
            at += n
        return out

    def of_source(self, s: int) -> range:
        return range(s * self.local, (s + 1) * self.local)


class HeldExchange(torch.autograd.Function):
    """``apply(dispatch, route, block, *weights)`` (see the module): ``dispatch`` [rows,
    hidden] sorted by destination slot, ``route`` its :class:`Route`, ``weights`` three per
    held expert (``w1``, ``w3``, ``w2``). Returns [rows, hidden]: row ``i`` is ``dispatch``
    row ``i`` through its expert."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, dispatch: torch.Tensor, route: Route, block: Any, *weights: torch.Tensor
    ) -> torch.Tensor:
        me, local = block.ep_rank, len(block.held)
        own, own_sizes = _own_rows(block, dispatch, route)
        pending = _launch_dispatch(block, dispatch, route)
        try:  # the own rows while the peers' rows are on the wire
            own_out = _run_pieces(own, own_sizes, weights)
        finally:
            received, peer_counts, send, recv = _finish_dispatch(pending, route, block)
        block.dispatch_counts = (send, recv)
        reached = peer_counts.view(block.ep_size, local).sum(dim=0).tolist()
        block.mark_idle(reached, learning=route.learning)
        if route.history is not None:
            route.history.record(send, recv)
        pieces = _Pieces([int(n) for n in peer_counts.tolist()], local)
        assert pieces.sizes[me * local : (me + 1) * local] == own_sizes, "own rows mismatch"
        results: list[tuple[torch.Tensor, ...] | None] = []
        for s, segment in enumerate(received.split(recv)):
            sizes = pieces.sizes[s * local : (s + 1) * local]
            results += own_out if s == me else _run_pieces(segment, sizes, weights)
        outputs = [r[0] for r in results if r is not None]
        out = torch.cat(outputs) if outputs else received.new_empty((0, received.shape[1]))
        back = launch(out, recv, send, block).wait()  # the combine a2a
        ctx.block, ctx.send, ctx.recv, ctx.pieces = block, send, recv, pieces
        ctx.save_for_backward(received, *weights, *(t for r in results if r for t in r[1:]))
        return back

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        block = ctx.block
        span = block.comm.open_span(block.ep_group)
        try:
            dx, weight_grads = _backward(ctx, grad.contiguous())
        finally:
            block.comm.close_span(span)
        return (dx, None, None, *weight_grads)


@dataclass
class _Grads:
    """Backward state: per non-empty piece, its output gradient, ``(dx, da, db)`` and its
    weight-gradient parts (``w1``, ``w3``, ``w2``)."""

    dy: dict[int, torch.Tensor]
    inner: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    parts: dict[int, list[torch.Tensor | None]]


def _piece_grads(
    ctx: Any, state: _Grads, index: int, dy: torch.Tensor, saved: Sequence[torch.Tensor]
) -> None:
    """Input gradient of piece ``index`` from its output gradient ``dy``."""
    j = index % ctx.pieces.local
    weights = ctx.weights[3 * j : 3 * j + 3]
    state.dy[index] = dy
    state.inner[index] = piece_input_grad(dy, weights, *saved)


def _weight_parts(ctx: Any, state: _Grads, index: int, rows: torch.Tensor, h: torch.Tensor) -> None:
    """Piece ``index``'s parts of its expert's weight gradients (``rows``: its input)."""
    j = index % ctx.pieces.local
    _, da, db = state.inner[index]
    sources = (da, rows), (db, rows), (state.dy[index], h)
    state.parts[index] = [
        g.t().mm(src) if ctx.needs_input_grad[3 + 3 * j + w] else None
        for w, (g, src) in enumerate(sources)
    ]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The node's backward (see the module): ``(grad of dispatch, weight gradients)``."""
    block, pieces = ctx.block, ctx.pieces
    me, local = block.ep_rank, pieces.local
    received, *rest = ctx.saved_tensors
    ctx.weights, saved = rest[: 3 * local], rest[3 * local :]
    starts = pieces.starts()
    live = [i for i, n in enumerate(pieces.sizes) if n]
    kept = {i: saved[4 * k : 4 * k + 4] for k, i in enumerate(live)}
    rows = {i: received[starts[i] : starts[i] + pieces.sizes[i]] for i in live}
    state = _Grads({}, {}, {})
    pending = launch(grad, ctx.send, ctx.recv, block)  # the combine's reverse a2a
    try:  # own rows: their output gradients never left this rank
        own_start = sum(ctx.send[:me]) - starts[me * local]
        for i in (i for i in pieces.of_source(me) if i in kept):
            at = own_start + starts[i]
            _piece_grads(ctx, state, i, grad[at : at + pieces.sizes[i]], kept[i])
            _weight_parts(ctx, state, i, rows[i], kept[i][3])
    finally:
        dy = pending.wait()
    for i in (i for i in live if i not in state.inner):
        _piece_grads(ctx, state, i, dy[starts[i] : starts[i] + pieces.sizes[i]], kept[i])
    inputs = [state.inner[i][0] for i in live]
    dx = torch.cat(inputs) if inputs else torch.zeros_like(received)
    pending = launch(dx, ctx.recv, ctx.send, block)  # the dispatch's reverse a2a
    try:  # the peers' rows' weight gradients while it is on the wire
        for i in (i for i in live if i not in state.parts):
            _weight_parts(ctx, state, i, rows[i], kept[i][3])
    finally:
        out = pending.wait()
    return out, _summed(state, live, local)


def _summed(state: _Grads, live: list[int], local: int) -> list[torch.Tensor | None]:
    """Each held expert's weight gradients: its pieces' parts summed in piece order (None for
    an expert no row reached)."""
    grads: list[torch.Tensor | None] = [None] * (3 * local)
    for i in live:
        j = i % local
        for w, part in enumerate(state.parts[i]):
            if part is not None:
                current = grads[3 * j + w]
                grads[3 * j + w] = part if current is None else current + part
    return grads
