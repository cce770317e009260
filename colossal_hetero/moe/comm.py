"""The meeting point of the MoE all-to-alls and the gradient reducers: gate and event log.

The expert-parallel blocks (moe/block.py) call :meth:`MoeComm.a2a_call` around every
all-to-all and open a *pending span* from the first a2a of a dispatch to the last a2a of its
combine (forward), and from the combine's backward a2a to the dispatch's backward a2a
(backward): the expert computation between the two is exactly when an a2a is pending. While a
span is open every attached :class:`ChunkedGradReducer` holds its chunks back (priority on).

With ``fit`` on (the default) the span itself no longer holds chunks; instead, as each a2a
call ends, every reducer gets a *window*: the expected start of the next a2a call (this
call's end plus the shortest gap seen after it in recent steps, :class:`GapModel`, times
``FIT_MARGIN``). A chunk goes inside the window only if its predicted all-reduce ends before
it, so gradient traffic overlaps the expert and attention compute between a2a's without being
on the wire when the next a2a starts; after the step's last a2a there is no window. Without a
history (the first step) nothing goes before the flush. ``fit`` off: the span holds them.

``events`` is the log of one step: a2a calls, pending spans and every reducer's chunks, each
``(kind, group, id, t_launch, t_done, nbytes)``; see :meth:`step_log`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch.distributed import ProcessGroup

from colossal_hetero.moe.scheduler import ChunkedGradReducer

LogRow = tuple[str, str, int, float, float, int]
"""One row of a step's log: (kind, group, id, t_launch, t_done, nbytes)."""

FIT_MARGIN = 0.9
"""Fraction of the expected gap before the next a2a that a chunk may use (timing jitter)."""


@dataclass
class GapModel:
    """Expected compute gaps between consecutive a2a calls of a step (pure; no collectives).

    Steps repeat the same a2a sequence, so the gap after call ``k`` (its end to the start of
    call ``k + 1``) in recent steps predicts the next one: the shortest of the last
    ``history`` steps with the same number of calls (conservative under jitter).
    """

    history: int = 3
    steps: list[list[tuple[float, float]]] = field(default_factory=list)

    def record(self, calls: Sequence[tuple[float, float]]) -> None:
        """Add one step's a2a calls ``(start, end)`` in issue order."""
        if calls:
            self.steps = [*self.steps, list(calls)][-self.history :]

    def gap_after(self, k: int) -> float | None:
        """Expected seconds from the end of call ``k`` to the start of call ``k + 1``;
        ``inf`` after the last call; None without a history (or ``k`` beyond it)."""
        same = [s for s in self.steps if len(s) == len(self.steps[-1])] if self.steps else []
        if not same or k >= len(same[-1]):
            return None
        if k == len(same[-1]) - 1:
            return float("inf")
        return min(step[k + 1][0] - step[k][1] for step in same)


@dataclass(slots=True)
class CommEvent:
    """An a2a call (``kind`` "a2a") or a pending span ("pending"); times from perf_counter."""

    kind: str
    id: int
    t_launch: float
    """When the span opened; for a call, when it was issued (``issued``)."""
    t_done: float | None = None
    nbytes: int = 0

    def issued(self) -> None:
        """Stamp the launch now, right after the call's asynchronous issue returned: a rank on
        an emulated device (emulation/interceptor.py) finishes the compute before it inside the
        issue, and the call starts on the wire only then (the gate opened before)."""
        self.t_launch = time.perf_counter()

    def finished(self) -> None:
        """Stamp the end now, if not stamped yet: called when an asynchronous call's transfer
        completes (its future's callback, moe/expert_ffn.py), which can be before it is waited."""
        if self.t_done is None:
            self.t_done = time.perf_counter()


@dataclass(slots=True)
class Span:
    """One open pending span; closed once (a second close is a no-op)."""

    event: CommEvent
    open: bool = True
    gated: bool = True


@dataclass
class MoeComm:
    """Gate and log shared by the MoE blocks and the gradient reducers of one model.

    ``reducers`` are named (``dense``, ``expert``); attach them with :meth:`attach` once the
    model is sharded. Without reducers the blocks still log their a2a calls.
    """

    log: bool = True
    fit: bool = True
    reducers: dict[str, ChunkedGradReducer] = field(default_factory=dict)
    events: list[CommEvent] = field(default_factory=list)
    gaps: GapModel = field(default_factory=GapModel)
    chooser: Any = None  # moe.pipeline_auto: a PipelineChooser, run by MoeStepLog
    split_step: bool = True  # step each group's parameters once reduced (moe/split_step.py)
    optim_steps: list[tuple[str, float, float]] = field(default_factory=list)
    _open: int = 0
    _count: int = 0
    _calls: list[tuple[float, float]] = field(default_factory=list)

    def attach(self, reducers: dict[str, ChunkedGradReducer]) -> None:
        """Gate ``reducers`` from now on (spans open now are not applied to them)."""
        if self._open:
            raise RuntimeError("attach reducers between steps, not inside a pending a2a")
        self.reducers = dict(reducers)

    def _event(self, kind: str, nbytes: int = 0) -> CommEvent:
        event = CommEvent(kind, self._count, time.perf_counter(), nbytes=nbytes)
        self._count += 1
        if self.log:
            self.events.append(event)
        return event

    def _gate(self, group: ProcessGroup) -> None:
        for reducer in self.reducers.values():
            reducer.open_a2a(group)
        self._open += 1

    def _ungate(self) -> None:
        self._open -= 1
        for reducer in self.reducers.values():
            reducer.close_a2a()

    def open_span(self, group: ProcessGroup) -> Span:
        """An a2a on ``group`` is pending from now: gradient chunks wait (priority on; with
        ``fit`` the windows protect the a2a calls instead, and the span is only logged)."""
        if not self.fit:
            self._gate(group)
        return Span(self._event("pending"), gated=not self.fit)

    def close_span(self, span: Span) -> None:
        """End ``span``; chunks that became ready meanwhile may go now."""
        if not span.open:
            return
        span.open = False
        span.event.t_done = time.perf_counter()
        if span.gated:
            self._ungate()

    @contextmanager
    def gated(self, group: ProcessGroup) -> Iterator[None]:
        """Hold gradient chunks back (priority on) around traffic on ``group`` that is not an
        a2a call of the step's fixed sequence (moe/folded.py's point-to-point overflow rows);
        not logged, no window."""
        self._gate(group)
        try:
            yield
        finally:
            self._ungate()

    @contextmanager
    def a2a_call(self, group: ProcessGroup, nbytes: int) -> Iterator[CommEvent]:
        """Gate and log one a2a call, from before it is issued until it has completed; then
        open the window up to the next call's expected start (``fit``)."""
        self._gate(group)
        event = self._event("a2a", nbytes)
        try:
            yield event
        finally:
            event.finished()
            assert event.t_done is not None
            self._calls.append((event.t_launch, event.t_done))
            if self.fit:
                gap = self.gaps.gap_after(len(self._calls) - 1)
                until = event.t_done if gap is None else event.t_done + FIT_MARGIN * gap
                for reducer in self.reducers.values():
                    reducer.window_until = None if until == float("inf") else until
            self._ungate()

    def idle(self, params: list[Any]) -> None:
        """``params`` get no gradient in the coming backward (experts no token reached): their
        chunks may go before the flush (see ``ChunkedGradReducer.mark_idle``)."""
        for reducer in self.reducers.values():
            reducer.mark_idle(params)

    def flush(self, on_reduced: Callable[[str, ChunkedGradReducer], None] | None = None) -> None:
        """Flush every reducer (before the optimizer step), unless no backward ran since the
        last flush: a rank whose experts got no tokens flushes its expert reducer all the
        same, because its dense gradients arrived (every data-parallel rank runs backward).

        ``on_reduced(name, reducer)`` is called for each reducer whose gradients are all
        reduced while another reducer still has a chunk on the wire (moe/split_step.py steps
        that group's parameters then, overlapping the other group's transfer).

        Chunks are waited oldest launch first across the groups, each wait refilling its
        group's window at once (waiting one group to the end first left the other's queued
        chunks unlaunched meanwhile: 12.7 ms in a measured step). No cycle of waits: a rank
        waits only on a chunk it launched, and along a would-be cycle each rank's awaited chunk
        would have to be launched strictly before the previous rank's, which cannot close."""
        if self._open:
            raise RuntimeError("flush with an a2a still pending: a MoE block's span never closed")
        if not any(reducer.touched for reducer in self.reducers.values()):
            return
        self.gaps.record(self._calls)
        self._calls = []
        reducers = list(self.reducers.values())
        for reducer in reducers:  # every group's chunks on the wire together
            reducer.launch_rest()
        early: set[int] = set()
        if on_reduced is not None:  # a group whose chunks all ended during backward
            self._report_reduced(on_reduced, early)
        while True:  # the oldest chunk of any group first, refilling its group's window
            waiting = [(r.oldest_launch(), i) for i, r in enumerate(reducers)]
            pending = [(t, i) for t, i in waiting if t is not None]
            if not pending:
                break
            reducers[min(pending)[1]].wait_oldest()
            if on_reduced is not None:
                self._report_reduced(on_reduced, early)
        for reducer in reducers:
            reducer.wait_all()

    def _report_reduced(
        self, on_reduced: Callable[[str, ChunkedGradReducer], None], early: set[int]
    ) -> None:
        """Call ``on_reduced`` for each reducer, not yet reported, with nothing left to launch
        or wait for while another still has a chunk on the wire."""
        items = list(self.reducers.items())
        for i, (name, reducer) in enumerate(items):
            if i in early or not reducer.reduced:
                continue
            others = [r for j, (_, r) in enumerate(items) if j != i]
            if any(r.oldest_launch() is not None for r in others):
                early.add(i)
                on_reduced(name, reducer)

    def clear(self) -> None:
        """Start a new step's log (and a2a call sequence)."""
        self._calls = []
        self.events.clear()
        self.optim_steps.clear()
        for reducer in self.reducers.values():
            reducer.clear_log()

    def step_log(
        self, origin: float | None = None
    ) -> list[tuple[str, str, int, float, float, int]]:
        """This step's events ``(kind, group, id, t_launch, t_done, nbytes)`` sorted by launch;
        times in seconds from ``origin`` (default: the first launch). Chunks carry their
        reducer's name as ``group``; a2a calls and spans carry ``ep``; an optimizer step of
        one group's parameters inside the flush (kind ``step``) carries the group's name."""
        rows: list[LogRow] = []
        for event in self.events:
            done = event.t_done if event.t_done is not None else event.t_launch
            rows.append((event.kind, "ep", event.id, event.t_launch, done, event.nbytes))
        for name, reducer in self.reducers.items():
            sizes = {index: numel for _, index, numel in reducer.collectives}
            for chunk in reducer.events:
                if chunk.kind != "chunk":
                    continue
                done = chunk.t_done if chunk.t_done is not None else chunk.t_launch
                nbytes = sizes.get(chunk.id, 0) * reducer.chunks[chunk.id].dtype.itemsize
                rows.append(("chunk", name, chunk.id, chunk.t_launch, done, nbytes))
        for name, t_start, t_end in self.optim_steps:  # early optimizer steps (split_step.py)
            rows.append(("step", name, 0, t_start, t_end, 0))
        rows.sort(key=lambda row: row[3])
        start = origin if origin is not None else (rows[0][3] if rows else 0.0)
        return [(k, g, i, a - start, b - start, n) for k, g, i, a, b, n in rows]


def chunks_inside(log: Sequence[LogRow], kind: str) -> int:
    """How many chunk launches fall strictly inside an event of ``kind`` ("a2a" or "pending")."""
    spans = [(a, b) for k, _, _, a, b, _ in log if k == kind]
    return sum(1 for k, _, _, t, _, _ in log if k == "chunk" and any(a < t < b for a, b in spans))
