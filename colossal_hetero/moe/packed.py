"""Packed expert dispatch (Lina's expert packing) for the expert-parallel Mixtral block.

Unpacked, the block sends one copy of a token per selected expert (``k`` rows). Packed, a
token goes once to every expert-parallel rank that hosts at least one of its top-k experts:

- the row carries the token's hidden state and, for each expert slot ``j`` of the destination
  rank (its experts in increasing index, padded to the widest rank), the token's routing
  weight and a 0/1 selection mark (exact in every float type; no ids as floats);
- the destination runs each of its experts on the rows that select it, weights each output
  and sums them per row (the combine happens there), and sends one row back;
- the source adds up the rows coming back from the token's ranks.

So both a2a's carry ``sum_t |{P(e) : e in topk[t]}|`` rows instead of ``T * k``
(:func:`.packing.a2a_sends` counts them). The result is Hugging Face's weighted sum of the
same expert outputs; only the order of that sum changes (per rank partial sums, then over
ranks), so outputs and gradients equal the unpacked block's within fp32 rounding. Gradients
reach the routing weights through the weight columns of the dispatch a2a.

The a2a primitives (gated, logged, autograd) are the block's own, passed in, so this module
does not import the block. Every rank issues the same calls whatever the routing: the counts
a2a, the dispatch, the combine, and both backward a2a's (a rank that receives nothing passes
the empty received tensor on, keeping it in the autograd graph).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

A2A = Callable[..., torch.Tensor]


@dataclass(slots=True)
class PackingStats:
    """Forward a2a traffic of this rank's own tokens to other ranks (local rows are not on
    the network), packed as sent and as the unpacked block would have sent it. Bytes count the
    dispatch rows (hidden state, plus the weight and mark columns when packed) and the combine
    rows that come back for them; the backward a2a's mirror both."""

    rows_packed: int = 0
    rows_unpacked: int = 0
    bytes_packed: int = 0
    bytes_unpacked: int = 0

    @property
    def bytes_saved(self) -> int:
        return self.bytes_unpacked - self.bytes_packed


def _rows_for(
    block: Any, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Per destination rank: the token indices sent there and their payload rows."""
    tokens, hidden = x.shape
    experts = block.num_experts
    device_of = torch.tensor(block.placement.device_of, dtype=torch.long, device=x.device)
    dev = device_of[selected]  # [T, k]
    width = max(block.device_sizes)
    w_full = x.new_zeros(tokens, experts).scatter(1, selected, weights)
    m_full = x.new_zeros(tokens, experts).scatter(1, selected, 1.0)
    rows, payloads = [], []
    for d in range(block.ep_size):
        index = (dev == d).any(dim=1).nonzero().squeeze(1)
        cols = torch.tensor(block.placement.experts_on(d), dtype=torch.long, device=x.device)
        pad = x.new_zeros(index.numel(), width - cols.numel())
        w = torch.cat([w_full[index][:, cols], pad], dim=1)
        m = torch.cat([m_full[index][:, cols], pad], dim=1)
        rows.append(index)
        payloads.append(torch.cat([x[index], w, m], dim=1))
    return rows, payloads, width


def packed_exchange(
    block: Any,
    x: torch.Tensor,
    selected: torch.Tensor,
    weights: torch.Tensor,
    a2a: A2A,
    dispatch: A2A,
    combine: A2A,
) -> torch.Tensor:
    """The block's MoE output ``[T, hidden]`` for tokens ``x`` routed to ``selected`` with
    normalised ``weights`` (both ``[T, k]``), packed (see the module).

    ``a2a(tensor, send, recv, group, comm)`` is the block's plain gated all-to-all;
    ``dispatch`` / ``combine`` its autograd a2a's ``(tensor, send, recv, block)``.
    """
    hidden = x.shape[1]
    rows, payloads, width = _rows_for(block, x, selected, weights)
    send = [int(r.numel()) for r in rows]
    with torch.no_grad():
        counts = torch.tensor(send, dtype=torch.long, device=x.device)
        ones = [1] * block.ep_size
        recv = a2a(counts, ones, ones, block.ep_group, block.comm).tolist()
    _account(block, selected, send, hidden, width, x.element_size())
    received = dispatch(torch.cat(payloads), send, recv, block)
    xs, w, m = received.split([hidden, width, width], dim=1)
    chosen = [m[:, j].nonzero().squeeze(1) for j in range(len(block.held))]
    if block.training and torch.is_grad_enabled():  # held experts no token reaches here
        idle = [
            p
            for j, index in enumerate(chosen)
            if index.numel() == 0
            for p in block.experts[block.held[j]].parameters()
        ]
        if idle:
            block.comm.idle(idle)
    out_local = xs  # no rows: the empty received tensor stands in (keeps both backward a2a's)
    if xs.shape[0]:
        out_local = xs.new_zeros(xs.shape)
        for j, index in enumerate(chosen):
            if index.numel() == 0:
                continue
            expert = block.experts[block.held[j]]
            piece = xs[index]
            y = expert.w2(expert.act_fn(expert.w1(piece)) * expert.w3(piece))
            out_local = out_local.index_add(0, index, y * w[index, j : j + 1])
    back = combine(out_local, recv, send, block)
    out = x.new_zeros(x.shape).index_add(0, torch.cat(rows), back.to(x.dtype))
    return out


def _account(
    block: Any, selected: torch.Tensor, send: list[int], hidden: int, width: int, itemsize: int
) -> None:
    """Add this forward's remote rows and bytes to ``block.packing_stats`` (made on first use)."""
    stats = getattr(block, "packing_stats", None)
    if stats is None:
        stats = block.packing_stats = PackingStats()
    me = block.ep_rank
    device_of = torch.tensor(block.placement.device_of, dtype=torch.long)
    packed = sum(send) - send[me]
    unpacked = int((device_of[selected.cpu()] != me).sum())
    stats.rows_packed += packed
    stats.rows_unpacked += unpacked
    stats.bytes_packed += packed * (2 * hidden + 2 * width) * itemsize
    stats.bytes_unpacked += unpacked * 2 * hidden * itemsize
