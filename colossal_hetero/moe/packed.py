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

Cost (session 11). On the benchmark's emulated devices every CPU operation between two
collectives is stretched, so the bookkeeping is vectorised: no loop over destinations, one
gather per side (``index_select``, whose backward is an ``index_add``, not the serial
accumulate of advanced indexing), one ``index_add`` per side, the routing tables cached per
placement. Once a block has a history the row counts ride in the dispatch a2a
(:mod:`.folded`, :class:`.a2a_autograd.FoldedDispatch`) instead of an a2a of their own.

The a2a primitives (gated, logged, autograd) are the block's own (:mod:`.a2a_autograd`). Every
rank issues the same calls whatever the routing: the counts a2a (until the block folds), the
dispatch, the combine, and both backward a2a's (a rank that receives nothing passes the
empty received tensor on, keeping it in the autograd graph).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from colossal_hetero.moe.a2a_autograd import Combine, Dispatch, FoldedDispatch, all_to_all_rows


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


@dataclass(frozen=True, slots=True)
class _Tables:
    """A placement's routing tables as tensors: each expert's rank and its column
    ``rank * width + slot`` in the ``[tokens, ep * width]`` weight and mark tables."""

    placement: Any
    device_of: torch.Tensor
    column_of: torch.Tensor
    width: int


def _tables(block: Any, device: torch.device) -> _Tables:
    """The block's tables for its current placement (made once per placement and device)."""
    cached = getattr(block, "packing_tables", None)
    if cached is not None and cached.placement is block.placement:
        if cached.device_of.device == device:
            return cached
    placement = block.placement
    width = max(block.device_sizes)
    column = [0] * block.num_experts
    for d in range(block.ep_size):
        for j, e in enumerate(placement.experts_on(d)):
            column[e] = d * width + j
    tables = _Tables(
        placement,
        torch.tensor(placement.device_of, dtype=torch.long, device=device),
        torch.tensor(column, dtype=torch.long, device=device),
        width,
    )
    block.packing_tables = tables
    return tables


def _payload(
    block: Any, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor, t: _Tables
) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
    """(token index of each row, rows sorted by destination rank, rows per rank, ``[T, k]``
    destination ranks): each row is ``[hidden | weights per slot | marks per slot]``."""
    tokens, ep, width = x.shape[0], block.ep_size, t.width
    dev = t.device_of[selected]  # [T, k]
    hit = torch.zeros(tokens, ep, dtype=torch.bool, device=x.device).scatter_(1, dev, True)
    pairs = hit.t().nonzero()  # (rank, token), rank-major, tokens increasing
    index, flat = pairs[:, 1], pairs[:, 1] * ep + pairs[:, 0]
    send = hit.sum(dim=0).tolist()
    columns = t.column_of[selected]  # distinct per token: a plain scatter
    w_table = x.new_zeros(tokens, ep * width).scatter(1, columns, weights)
    m_table = x.new_zeros(tokens, ep * width).scatter_(1, columns, 1.0)
    w_rows = w_table.view(tokens * ep, width).index_select(0, flat)
    m_rows = m_table.view(tokens * ep, width).index_select(0, flat)
    rows = torch.cat([x.index_select(0, index), w_rows, m_rows], dim=1)
    return index, rows, send, dev


def _counts_exchange(
    block: Any, rows: torch.Tensor, send: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """(received rows, rows from each rank): the row counts folded into the dispatch a2a
    once the block has a history (moe/folded.py), else an a2a of counts first."""
    history = block._fold_history()
    if history is not None and history.ready and block._may_fold(rows):
        # Header counts per expert slot: a rank's rows on its first slot (a rank with no
        # experts gets no rows, and its empty header slice reads as zero).
        counts = torch.zeros(block.num_experts, dtype=torch.long, device=rows.device)
        starts = [sum(block.device_sizes[:d]) for d in range(block.ep_size)]
        for d, n in enumerate(send):
            if n:
                counts[starts[d]] = n
        received, peer_counts = FoldedDispatch.apply(rows, counts, block)
        local = len(block.held)
        recv = [0] * block.ep_size
        if local:
            recv = peer_counts.view(block.ep_size, local).sum(dim=1).tolist()
    else:
        with torch.no_grad():
            counts = torch.tensor(send, dtype=torch.long, device=rows.device)
            ones = [1] * block.ep_size
            recv = all_to_all_rows(counts, ones, ones, block.ep_group, block.comm).tolist()
        received = Dispatch.apply(rows, send, recv, block)
    if history is not None:
        history.record(send, recv)
    return received, recv


def _experts(
    block: Any, received: torch.Tensor, recv: list[int], hidden: int, width: int
) -> torch.Tensor:
    """This rank's combined rows ``[received, hidden]``: each held expert on the rows that
    select it (one gather, grouped by slot), weighted, summed per row (one ``index_add``).

    An expert runs once per source rank, on that rank's rows, as the unpacked block does, so
    both run matmuls of the same shapes. oneDNN builds a bf16 kernel per new shape (on this
    host ~80 page faults and ~0.3 ms of CPU a call) and caches it: one piece over all sources
    ran shapes no other variant of ``bench moe``'s rounds had built, and paid that each step
    (session 11: +2.5 ms of forward CPU, stretched 2.5x on the emulated devices)."""
    xs, w, m = received.split([hidden, width, width], dim=1)
    local = len(block.held)
    marks = m[:, :local].t() != 0  # [local, rows]
    pairs = marks.nonzero()  # (slot, row), slot-major; rows (so source ranks) increasing
    rows = pairs[:, 1]
    by_source = torch.stack([part.sum(dim=1) for part in marks.split(recv, dim=1)], dim=1)
    pieces = by_source.reshape(-1).tolist()  # (slot, source rank), slot-major
    per_slot = by_source.sum(dim=1).tolist()
    block.mark_idle(per_slot)
    if not received.shape[0]:
        return xs  # no rows: the empty received tensor stands in (keeps both backward a2a's)
    outputs = []
    ep = len(recv)
    for i, piece in enumerate(xs.index_select(0, rows).split(pieces)):
        if pieces[i]:
            expert = block.experts[block.held[i // ep]]
            outputs.append(expert.w2(expert.act_fn(expert.w1(piece)) * expert.w3(piece)))
    scale = w[:, :local].t()[marks].unsqueeze(1)  # the weights in the order of ``pairs``
    weighted = torch.cat(outputs) * scale if outputs else xs[:0]
    return xs.new_zeros(xs.shape[0], hidden).index_add(0, rows, weighted)


def packed_exchange(
    block: Any,
    x: torch.Tensor,
    selected: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The block's MoE output ``[T, hidden]`` for tokens ``x`` routed to ``selected`` with
    normalised ``weights`` (both ``[T, k]``), packed (see the module)."""
    hidden = x.shape[1]
    tables = _tables(block, x.device)
    index, rows, send, dev = _payload(block, x, selected, weights, tables)
    _account(block, dev, send, hidden, tables.width, x.element_size())
    received, recv = _counts_exchange(block, rows, send)
    out_local = _experts(block, received, recv, hidden, tables.width)
    back = Combine.apply(out_local, recv, send, block)
    return x.new_zeros(x.shape).index_add(0, index, back.to(x.dtype))


def _account(
    block: Any, dev: torch.Tensor, send: list[int], hidden: int, width: int, itemsize: int
) -> None:
    """Add this forward's remote rows and bytes to ``block.packing_stats`` (made on first use);
    ``dev``: each (token, choice)'s destination rank."""
    stats = getattr(block, "packing_stats", None)
    if stats is None:
        stats = block.packing_stats = PackingStats()
    me = block.ep_rank
    packed = sum(send) - send[me]
    unpacked = int((dev != me).sum())
    stats.rows_packed += packed
    stats.rows_unpacked += unpacked
    stats.bytes_packed += packed * (2 * hidden + 2 * width) * itemsize
    stats.bytes_unpacked += unpacked * 2 * hidden * itemsize
