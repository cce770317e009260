"""a2a/expert pipelining: dispatch and combine in token ranges, one range's experts overlapping
the next range's all-to-all (issue 11, item 3).

The block's tokens are cut into ``n`` contiguous ranges. One small a2a tells every rank the row
counts of every (range, expert) at once; then, in forward,

- the dispatch a2a's of all ranges are issued asynchronously, in range order (one group, so
  the wire takes them in that order);
- range ``g``'s experts run as soon as its dispatch has arrived, while ranges ``g + 1, ...``
  are still on the wire, and its combine a2a is issued as soon as its outputs exist;

and backward mirrors it: the combine's reverse a2a's of all ranges are issued, range ``g``'s
expert backward runs when its gradient has arrived, and its dispatch's reverse a2a is issued
right after. Every rank issues the same a2a sequence, ``1 + 2n`` forward and ``2n`` backward,
whatever the routing (empty ranges send and receive empty tensors), so nothing can hang.

Numerics: each row meets the same expert function as in the unpipelined block and its output
lands in the same row; only the expert matmuls run on fewer rows at a time.

Autograd: one ``autograd.Function`` covers the exchange, with the held experts' parameters
among its inputs. The expert graphs built in forward are differentiated in backward with
``torch.autograd.grad`` (which accumulates nothing), and the Function returns the parameters'
gradients summed over the ranges, so each parameter's gradient is accumulated, and the
chunked reducer's hook fires, once per backward, as without pipelining. Every a2a runs inside
:meth:`.comm.MoeComm.a2a_call`, open from issue to wait; the backward inside a pending span.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class _Range:
    """One token range's routing."""

    rows: torch.Tensor  # the token (row of x) of each dispatched row, in slot order
    order: torch.Tensor  # the range-local rows t * k + j in slot order
    send: list[int]  # dispatched rows to each ep rank
    recv: list[int]  # rows received from each ep rank
    pieces: list[int]  # received rows per (source rank, held expert), in received order


class _Wire:
    """Asynchronous a2a's on the block's ep group, each gated and logged from issue to wait;
    waited in issue order (the order the group runs them)."""

    def __init__(self, block: Any) -> None:
        self.block = block
        self.open: deque[Any] = deque()

    def issue(self, x: torch.Tensor, send: list[int], recv: list[int]) -> tuple[Any, Any]:
        x = x.contiguous()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        call = self.block.comm.a2a_call(self.block.ep_group, x.numel() * x.element_size())
        event = call.__enter__()
        self.open.append(call)
        work = dist.all_to_all_single(out, x, recv, send, group=self.block.ep_group, async_op=True)
        event.issued()
        return work, out

    def wait(self, handle: tuple[Any, Any]) -> torch.Tensor:
        work, out = handle
        work.wait()
        self.open.popleft().__exit__(None, None, None)
        return out


def plan_ranges(block: Any, selected: torch.Tensor, n: int) -> list[_Range]:
    """Route ``selected`` (tokens x top-k) in ``n`` token ranges; one counts a2a (collective)."""
    k, local, ep = block.top_k, len(block.held), block.ep_size
    slot_of = block.slot_of.to(selected.device)
    bounds = torch.arange(selected.shape[0]).tensor_split(n)
    routed = []
    for tokens in bounds:
        slots = slot_of[selected[tokens].reshape(-1)]
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=block.num_experts)
        rows = tokens[order // k] if tokens.numel() else tokens
        routed.append((rows, order, counts))
    table = torch.stack([c for _, _, c in routed])  # (n, experts), columns in slot order
    by_device = table.split(block.device_sizes, dim=1)
    send_counts = torch.cat([d.reshape(-1) for d in by_device])
    wire = _Wire(block)
    with torch.no_grad():
        handle = wire.issue(send_counts, [n * s for s in block.device_sizes], [n * local] * ep)
        peer = wire.wait(handle).view(ep, n, local)
    block.mark_idle(peer.sum(dim=(0, 1)).tolist())
    ranges = []
    for g, (rows, order, _) in enumerate(routed):
        send = [int(d[g].sum()) for d in by_device]
        recv = peer[:, g, :].sum(dim=1).tolist()
        ranges.append(_Range(rows, order, send, recv, peer[:, g, :].reshape(-1).tolist()))
    return ranges


def pipelined_exchange(block: Any, x: torch.Tensor, selected: torch.Tensor, n: int) -> Any:
    """Rows ``t * k + j``: expert ``selected[t, j]``'s output for token ``t`` (as the block's
    unpipelined exchange), with dispatch, experts and combine pipelined over ``n`` ranges."""
    ranges = plan_ranges(block, selected, n)
    params = [p for e in block.held for p in block.experts[e].parameters()]
    return _Pipelined.apply(x, block, ranges, *params)


def _expert_rows(block: Any, received: torch.Tensor, pieces: list[int]) -> torch.Tensor:
    local = len(block.held)
    outputs = []
    for index, piece in enumerate(received.split(pieces)):
        if piece.shape[0]:
            expert = block.experts[block.held[index % local]]
            outputs.append(expert.w2(expert.act_fn(expert.w1(piece)) * expert.w3(piece)))
    return torch.cat(outputs) if outputs else received[:0] * 1


def _inverse(order: torch.Tensor) -> torch.Tensor:
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel(), device=order.device)
    return restore


class _Pipelined(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, block: Any, ranges: Any, *params: Any) -> Any:
        ctx.block, ctx.ranges, ctx.params, ctx.x_shape = block, ranges, params, x.shape
        wire = _Wire(block)
        sent = [wire.issue(x[r.rows], r.send, r.recv) for r in ranges]
        graphs, combines = [], []
        for r, handle in zip(ranges, sent, strict=True):
            received = wire.wait(handle).detach().requires_grad_()
            with torch.enable_grad():
                out = _expert_rows(block, received, r.pieces)
            graphs.append((received, out))
            combines.append(wire.issue(out.detach(), r.recv, r.send))
        backs = [wire.wait(handle) for handle in combines]
        ctx.graphs = graphs
        return torch.cat([b[_inverse(r.order)] for b, r in zip(backs, ranges, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        block, ranges = ctx.block, ctx.ranges
        span = block.comm.open_span(block.ep_group)
        try:
            wire = _Wire(block)
            sizes = [r.order.numel() for r in ranges]
            pending = [
                wire.issue(g[r.order], r.send, r.recv)
                for g, r in zip(grad.split(sizes), ranges, strict=True)
            ]
            total: list[Any] = [None] * len(ctx.params)
            returned = []
            for (received, out), handle, r in zip(ctx.graphs, pending, ranges, strict=True):
                g_out = wire.wait(handle)
                g_in, *g_params = _grads(received, out, ctx.params, g_out)
                total = [_add(a, b) for a, b in zip(total, g_params, strict=True)]
                returned.append(wire.issue(g_in, r.recv, r.send))
            dx = grad.new_zeros(ctx.x_shape)
            for handle, r in zip(returned, ranges, strict=True):
                dx.index_add_(0, r.rows, wire.wait(handle))
        finally:
            block.comm.close_span(span)
        ctx.graphs = None
        return (dx, None, None, *total)


def _grads(received: Any, out: Any, params: Any, g_out: Any) -> list[Any]:
    """Gradients of ``out`` (one range's expert rows) for its received rows and the params;
    None for parameters it does not use."""
    if out.shape[0] == 0 or not out.requires_grad:
        return [torch.zeros_like(received), *([None] * len(params))]
    got = torch.autograd.grad(out, [received, *params], g_out, allow_unused=True)
    first = got[0] if got[0] is not None else torch.zeros_like(received)
    return [first, *got[1:]]


def _add(a: Any, b: Any) -> Any:
    if a is None:
        return b
    return a if b is None else a + b
