"""The routing counts carried inside the dispatch a2a: one a2a fewer per layer and forward.

Unfolded, a block's forward first exchanges the row counts (a few bytes, but a whole a2a:
on the shaped links of ``bench moe`` 1-2.5 ms, a wake-up of every peer) so that each rank
knows how many rows it will receive. Folded, each rank sends every peer one *header row*
holding the counts for that peer's experts, followed by the rows themselves padded to a
*capacity*, so the receive sizes are known in advance:

- The capacity of the pair (sender ``s``, receiver ``d``) is a pure function of the rows
  ``s`` sent ``d`` in the block's last ``HISTORY`` forwards (:func:`capacity`). Both ends
  saw those numbers (the sender counted them, the receiver read them from the headers), so
  they agree without any message. Until a block has that history it exchanges the counts.
- Rows beyond the capacity (the routing shifted) go point to point inside the ep group
  right after the a2a: the sender knows its counts, the receiver learns them from the
  header, so exactly the two ranks of that pair take part and every size is exact. Rows a
  rank sends itself beyond the capacity are copied.
- The header is the counts as int32 bytes in a row of the dispatched tensor's bytes (the a2a
  carries bytes: exact whatever the float type). It needs ``4 * experts per rank`` bytes of
  a row; a block whose rows are too short keeps the counts a2a.

Backward is unchanged: the reverse a2a with the exact sizes. What is sent and computed is
the same rows as unfolded (the padding is never read), so outputs and gradients are equal.
Only the forward's a2a log changes (no counts call), so with ``moe.pipeline_auto`` a block
folds only once the pipelining choice, which measures the counts a2a's, is made.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

HISTORY = 3
"""Forwards of a block whose per-pair row counts set the capacity."""
MARGIN, SLACK = 1.1, 8
"""Capacity = ``ceil(MARGIN * most rows of the history) + SLACK``."""


def capacity(history: Sequence[int]) -> int:
    """Rows reserved for one (sender, receiver) pair from its recent row counts (pure)."""
    return math.ceil(MARGIN * max(history)) + SLACK if history else 0


@dataclass
class PairHistory:
    """Rows this rank sent each ep peer (``sent``) and got from each (``got``), last forwards."""

    peers: int
    sent: list[deque[int]] = field(default_factory=list)
    got: list[deque[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sent = [deque(maxlen=HISTORY) for _ in range(self.peers)]
        self.got = [deque(maxlen=HISTORY) for _ in range(self.peers)]

    @property
    def ready(self) -> bool:
        """Whether every pair has a history (the same answer at both ends of each pair)."""
        return all(self.sent) and all(self.got)

    def record(self, send: Sequence[int], recv: Sequence[int]) -> None:
        for d in range(self.peers):
            self.sent[d].append(int(send[d]))
            self.got[d].append(int(recv[d]))


def header_fits(row_bytes: int, device_sizes: Sequence[int]) -> bool:
    """Whether one row holds the int32 counts of the experts of any ep rank."""
    return 4 * max(device_sizes) <= row_bytes


def _header(counts: torch.Tensor, row_bytes: int, device: torch.device) -> torch.Tensor:
    row = torch.zeros(1, row_bytes, dtype=torch.uint8, device=device)  # the payload's device
    raw = counts.to(device=device, dtype=torch.int32).contiguous().view(torch.uint8)
    row[0, : raw.numel()] = raw
    return row


def _pack(
    rows: torch.Tensor, counts: list[torch.Tensor], caps: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """Per peer: header row, its rows up to the capacity, zero padding; and ``send`` rows."""
    send = [int(c.sum()) for c in counts]
    parts, start = [], 0
    for c, n, cap in zip(counts, send, caps, strict=True):
        parts.append(_header(c, rows.shape[1], rows.device))
        kept = rows[start : start + min(n, cap)]
        parts.append(kept)
        if cap > kept.shape[0]:
            parts.append(rows.new_zeros(cap - kept.shape[0], rows.shape[1]))
        start += n
    return torch.cat(parts), send


@dataclass
class FoldedLaunch:
    """A folded dispatch on the wire (:func:`launch_folded`); :func:`finish_folded` ends it.
    ``stack`` holds the a2a's gate open until then."""

    block: Any
    rows: torch.Tensor  # this rank's rows as bytes (kept alive until the transfer ends)
    payload: torch.Tensor
    out: torch.Tensor
    work: Any
    stack: ExitStack
    dtype: torch.dtype
    send: list[int]
    caps_send: list[int]
    caps_recv: list[int]


def launch_folded(
    block: Any, dispatch: torch.Tensor, counts: torch.Tensor, history: PairHistory
) -> FoldedLaunch:
    """Issue one folded dispatch a2a asynchronously (inside its gate; see the module).

    ``dispatch`` holds this rank's rows sorted by destination slot and ``counts`` the rows
    per expert slot (``block.device_sizes`` experts per rank, in rank order). Collective on
    ``block.ep_group`` (one ``all_to_all_single``); no autograd here.
    """
    row_bytes = dispatch.shape[1] * dispatch.element_size()
    rows = dispatch.contiguous().view(torch.uint8)
    caps_send = [capacity(h) for h in history.sent]
    caps_recv = [capacity(h) for h in history.got]
    payload, send = _pack(rows, list(counts.split(block.device_sizes)), caps_send)
    out = rows.new_empty(sum(caps_recv) + block.ep_size, row_bytes)
    splits_in, splits_out = [c + 1 for c in caps_send], [c + 1 for c in caps_recv]
    stack = ExitStack()
    event = stack.enter_context(block.comm.a2a_call(block.ep_group, payload.numel()))
    try:
        work = dist.all_to_all_single(
            out, payload, splits_out, splits_in, group=block.ep_group, async_op=True
        )
        assert work is not None
        event.issued()
    except BaseException:
        stack.close()
        raise
    try:
        work.get_future().then(lambda _: event.finished())  # the log holds the transfer alone
    except RuntimeError:  # a backend without futures: the end as waited
        pass
    dtype = dispatch.dtype
    return FoldedLaunch(block, rows, payload, out, work, stack, dtype, send, caps_send, caps_recv)


def finish_folded(
    launched: FoldedLaunch,
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """(received rows, counts per (peer, held expert), send, recv) of a launched dispatch:
    waits for its a2a (closing the gate), then moves the rows beyond the capacities point to
    point (:func:`_overflow`, collective on the pairs concerned)."""
    block = launched.block
    try:
        launched.work.wait()
    finally:
        launched.stack.close()
    ep, local = block.ep_size, len(block.held)
    splits_out = [c + 1 for c in launched.caps_recv]
    blocks = launched.out.split(splits_out)
    got = [b[0, : 4 * local].clone().view(torch.int32).to(torch.long) for b in blocks]
    recv = [int(g.sum()) for g in got]
    send, caps_send, caps_recv = launched.send, launched.caps_send, launched.caps_recv
    extra = _overflow(block, launched.rows, send, recv, caps_send, caps_recv)
    pieces = []
    for s in range(ep):
        pieces.append(blocks[s][1 : 1 + min(recv[s], caps_recv[s])])
        if s in extra:
            pieces.append(extra[s])
    received = torch.cat(pieces) if pieces else launched.out[:0]
    return received.view(launched.dtype), torch.cat(got), send, recv


def folded_dispatch(
    block: Any, dispatch: torch.Tensor, counts: torch.Tensor, history: PairHistory
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """(received rows, counts per (peer, held expert), send, recv) of one folded dispatch,
    launched and waited (:func:`launch_folded`, :func:`finish_folded`). No autograd here:
    the block's :class:`.a2a_autograd.FoldedDispatch` wraps it."""
    return finish_folded(launch_folded(block, dispatch, counts, history))


def _overflow(
    block: Any,
    rows: torch.Tensor,
    send: list[int],
    recv: list[int],
    caps_send: list[int],
    caps_recv: list[int],
) -> dict[int, torch.Tensor]:
    """Rows beyond the pairs' capacities, point to point (each pair's two ranks only; its
    own rows copied); returns the rows got per source peer."""
    me, group = block.ep_rank, block.ep_group
    starts = [sum(send[:d]) for d in range(block.ep_size)]
    extra: dict[int, torch.Tensor] = {}
    works = []
    with block.comm.gated(group):
        for d in range(block.ep_size):
            if send[d] > caps_send[d] and d != me:
                chunk = rows[starts[d] + caps_send[d] : starts[d] + send[d]].contiguous()
                works.append(dist.isend(chunk, dist.get_global_rank(group, d), group=group))
        for s in range(block.ep_size):
            if recv[s] <= caps_recv[s]:
                continue
            if s == me:
                extra[s] = rows[starts[me] + caps_send[me] : starts[me] + send[me]]
                continue
            buf = rows.new_empty(recv[s] - caps_recv[s], rows.shape[1])
            works.append(dist.irecv(buf, dist.get_global_rank(group, s), group=group))
            extra[s] = buf
        for work in works:
            if work is not None:
                work.wait()
    return extra
