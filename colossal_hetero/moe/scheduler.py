"""Chunked, prioritised gradient all-reduce (Lina's a2a-over-all-reduce priority), runtime half.

Contract, for one data-parallel ``group`` (the gradient group):

- Gradients are reduced in the fixed chunks of :func:`.chunks.plan_chunks` (routing-independent).
  A post-accumulate-grad hook marks a parameter ready; a chunk is *ready* when all its
  parameters are. Chunks are launched with async ``all_reduce`` (SUM, then divided by the group
  size if ``average``) on ``group``, strictly in chunk order: chunk ``c`` is launched only after
  chunks ``0..c-1``.
- At most ``max_inflight`` chunks are on the wire (``None``: no limit). A full window never
  blocks a hook: the chunk waits in the queue and a later hook, the end of an a2a or ``flush``
  launches it.
- With ``priority`` on, no chunk is launched while an a2a is open: callers wrap every MoE
  all-to-all (from the moment it is pending until its handle is waited) in
  ``with scheduler.a2a(): ...``. Chunks that become ready then are queued and launched when the
  last open a2a closes. With ``priority`` off the gate is ignored: plain bucketed overlap, each
  chunk launched as soon as it and its predecessors are ready (DDP/DeepSpeed-like).
- Gap fitting (priority on): while ``window_until`` is set (a ``perf_counter`` time, set by
  :class:`.comm.MoeComm` from the next a2a's expected start), a chunk is launched only if its
  predicted duration (:meth:`predict`, the measured alpha-beta profile scaled by what recent
  lone chunks really took) ends before it; ``None``: no a2a ahead, no limit.
- ``flush()`` (before ``optimizer.step()``) zero-fills gradients this rank never produced (an
  expert that got no tokens here), launches every remaining chunk in order and waits for all.
  Afterwards every gradient equals a plain all-reduce of the same gradients.
- ``learn_order``: the first backward launches no chunk; its flush re-plans the chunks once
  in the order the gradients arrived on the group's first rank (broadcast to the group) and
  only then reduces them, so that early chunks hold only gradients backward produces early,
  and every reduction (a resumed run's first included) uses that one layout. Fixed from then
  on, routing-independent. It also learns each gradient's *phase*, how many a2a gates had
  closed when it arrived, and cuts the chunks at phase changes (:func:`.chunks.phase_runs`):
  a chunk then never waits for a gradient that comes only after a later a2a. ``phases``
  gives such labels up front instead (the experts' MoE layer, moe/wiring.py).
- Gradient accumulation: while ``syncing()`` is False (the model's ``no_sync``, see
  moe/wiring.py) hooks and :meth:`mark_idle` do nothing, so a backward only accumulates into
  ``.grad``; the first backward with ``syncing()`` True (the last micro-step) marks and
  launches the chunks of the accumulated gradients as usual, and a flush with only
  accumulated gradients reduces them all. One *syncing* backward per flush: a second gradient
  for the same parameter before ``flush`` raises RuntimeError.

Why this cannot hang on gloo, where the collectives of one group must be issued in the same
order on every rank: the gradient group only ever sees ``all_reduce(chunk 0), ..., all_reduce(
chunk C-1)``, with chunk sizes fixed by parameter shapes, on every rank and every step; the
gate, the window and routing change only *when* a chunk is issued, never which or in what
order. The a2a runs on a different group (an error if the same group is passed to ``a2a``), so
the two sequences never interleave within one group. Nothing blocks on a chunk except
``flush``, which a rank reaches only after issuing all its a2as of the step; a chunk it waits
on is issued by every other rank at the latest in that rank's own ``flush``, whose waits are on
earlier chunks only (induction on the chunk order), so there is no cycle of waits.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from colossal_hetero.moe.chunks import Chunk, choose_run_chunk_bytes, plan_chunks
from colossal_hetero.utils.collectives import broadcast_anywhere


@dataclass(slots=True)
class Event:
    """One communication: ``kind`` "chunk" (all-reduce) or "a2a"; times from ``perf_counter``.

    For a chunk, ``t_done`` is when it completed (its future's callback), or failing that when
    its completion was observed; for an a2a, when its gate closed. ``None`` until then.
    ``alone``: a chunk launched with no other chunk of its reducer in flight; ``deadline``:
    the window it was launched under (None: none) and ``predicted`` its predicted duration.
    """

    kind: str
    id: int
    t_launch: float
    t_done: float | None = None
    alone: bool = False
    deadline: float | None = None
    predicted: float | None = None


def _stamp(event: Event) -> None:
    if event.t_done is None:  # the callback may run after a wait() already observed it
        event.t_done = time.perf_counter()


def _always() -> bool:
    return True


@dataclass(slots=True)
class _InFlight:
    chunk: Chunk
    work: dist.Work
    flat: torch.Tensor
    event: Event


class ChunkedGradReducer:
    """Chunked, prioritised all-reduce of ``params``' gradients over ``group`` (see the module).

    ``events`` logs every chunk and a2a of the reducer's life; ``collectives`` lists the
    chunks' all-reduces on the gradient group as ``("all_reduce", chunk index, numel)``, in
    issue order (``learn_order``'s one broadcast, in the first flush, is not in it).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: ProcessGroup,
        chunk_bytes: int,
        max_inflight: int | None = 2,
        priority: bool = True,
        average: bool = False,
        divisor: int | None = None,
        learn_order: bool = False,
        phases: Callable[[Sequence[nn.Parameter]], Sequence[int]] | None = None,
    ) -> None:
        if group is None:
            raise ValueError("ChunkedGradReducer: group is required (None means the world group)")
        if max_inflight is not None and max_inflight < 1:
            raise ValueError(f"moe.max_inflight must be >= 1 or None, got {max_inflight}")
        self._chunk_bytes = chunk_bytes  # kept for rebind; the largest with size_over_runs
        self._runs_profile: tuple[float, float, int] | None = None  # size_over_runs
        # Distinct trainable parameters, in the given order (a repeat would hook twice).
        self._params = list({id(p): p for p in params if p.requires_grad}.values())
        self._learn_order = self._learn = learn_order
        self._arrivals: list[tuple[int, int]] = []  # (parameter, phase) as gradients arrive
        self._closings = 0  # a2a gates closed since the last flush: the phase of an arrival
        self._order: list[int] | None = None
        self._phase_of = phases
        self.chunks = self._default_chunks()
        self._group = group
        self._max_inflight = max_inflight
        self._priority = priority
        # The sum is divided by ``divisor`` when given, else by the group size if ``average``
        # (expert gradients: summed over their replicas, averaged over all data-parallel ranks).
        self._divisor: int | None = divisor
        if divisor is None and average:
            self._divisor = dist.get_world_size(group)
        if self._divisor is not None and self._divisor < 1:
            raise ValueError(f"ChunkedGradReducer: divisor must be >= 1, got {divisor}")
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._chunks_of: list[list[int]] = []
        self._plan(self.chunks)
        self.events: list[Event] = []
        self.collectives: list[tuple[str, int, int]] = []
        self._inflight: deque[_InFlight] = deque()
        self._open_a2a = 0
        self._a2a_count = 0
        self.window_until: float | None = None
        self._profile: tuple[float, float] | None = None
        self._ratios: deque[float] = deque(maxlen=8)
        self.syncing: Callable[[], bool] = _always
        """False while gradients only accumulate locally (the model's ``no_sync``)."""
        self._reset()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self._params)
        ]

    def _default_chunks(self) -> tuple[Chunk, ...]:
        """The chunks before any order is learnt: default walk, ``phases``' labels if given."""
        labels = None if self._phase_of is None else list(self._phase_of(self._params))
        numels, dtypes = [p.numel() for p in self._params], [p.dtype for p in self._params]
        size = self._size_for(numels, dtypes, None, labels)
        return plan_chunks(numels, dtypes, size, phases=labels)

    def size_over_runs(self, alpha_s: float, beta_bytes_per_s: float, min_bytes: int) -> None:
        """From now on, size the chunks by :func:`.chunks.choose_run_chunk_bytes` with this
        profile (the sizes its plans over the phase runs really make; at most the reducer's
        ``chunk_bytes``, at least ``min_bytes``): now for the default plan, again when the
        order is learnt. Between steps, before the first backward or after a flush."""
        if self._inflight or self.touched:
            raise RuntimeError("ChunkedGradReducer.size_over_runs: between steps only")
        if alpha_s < 0 or beta_bytes_per_s <= 0:
            raise ValueError("ChunkedGradReducer.size_over_runs: need alpha >= 0 and beta > 0")
        self._runs_profile = (alpha_s, beta_bytes_per_s, min(min_bytes, self._chunk_bytes))
        if self._order is None:
            self._plan(self._default_chunks())
            self._reset()

    def _size_for(
        self,
        numels: list[int],
        dtypes: list[torch.dtype],
        order: list[int] | None,
        phases: list[int] | None,
    ) -> int:
        """The chunk size for a plan: ``chunk_bytes``, or chosen over the runs
        (:meth:`size_over_runs`)."""
        if self._runs_profile is None or not numels:
            return self._chunk_bytes
        alpha, beta, least = self._runs_profile
        return choose_run_chunk_bytes(
            numels,
            dtypes,
            alpha,
            beta,
            order=order,
            phases=phases,
            min_bytes=least,
            max_bytes=self._chunk_bytes,
        )

    def _reset(self) -> None:
        self._arrivals = []
        self._closings = 0
        self._ready = [False] * len(self._params)
        self._missing = [len(c.params) for c in self.chunks]
        self._next = 0
        self._accumulated = False  # a backward ran under no_sync since the last flush

    @property
    def touched(self) -> bool:
        """Whether any gradient arrived since the last flush (a backward ran here, syncing or
        accumulating under ``no_sync``)."""
        return self._accumulated or any(self._ready)

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_grad(_: torch.Tensor) -> None:
            if not self.syncing():  # no_sync: the gradient stays in .grad, reduced later
                self._accumulated = True
                return
            self._arrivals.append((index, self._closings))
            self._mark_ready(index)
            self._pump()

        return on_grad

    def mark_idle(self, params: Sequence[nn.Parameter]) -> None:
        """``params`` (those of this reducer; others are ignored) get no gradient in this
        backward, e.g. an expert that no token reached: their gradients are zeros from now, so
        their chunks need not wait for ``flush``. Already ready ones are left alone. Under
        ``no_sync`` nothing is marked (a later micro-step may still bring gradients)."""
        if not self.syncing():
            return
        for param in params:
            index = self._index.get(id(param))
            if index is None or self._ready[index]:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            self._mark_ready(index)
        self._pump()

    def _mark_ready(self, index: int) -> None:
        if self._ready[index]:
            raise RuntimeError(
                f"parameter {index} got a second gradient before flush(): one syncing backward "
                f"per flush (accumulate the earlier micro-steps under booster.no_sync)"
            )
        self._ready[index] = True
        for c in self._chunks_of[index]:
            self._missing[c] -= 1

    @property
    def priority(self) -> bool:
        """Whether open a2a's hold chunks back; settable between steps (not inside an a2a)."""
        return self._priority

    @priority.setter
    def priority(self, value: bool) -> None:
        if self._open_a2a:
            raise RuntimeError("change priority between steps, not inside an a2a")
        self._priority = value

    @property
    def gated(self) -> bool:
        """True while a chunk may not be launched because an a2a is open (priority on)."""
        return self._priority and self._open_a2a > 0

    def set_profile(self, alpha_s: float, beta_bytes_per_s: float) -> None:
        """The measured cost ``alpha + bytes / beta`` of one all-reduce on this group (the same
        on every rank: agreed before), which :meth:`predict` starts from."""
        if alpha_s < 0 or beta_bytes_per_s <= 0:
            raise ValueError("ChunkedGradReducer.set_profile: need alpha >= 0 and beta > 0")
        self._profile = (alpha_s, beta_bytes_per_s)

    @property
    def profile(self) -> tuple[float, float] | None:
        """(alpha seconds, beta bytes/s) given to :meth:`set_profile`; None before."""
        return self._profile

    def predict(self, chunk: Chunk) -> float | None:
        """Predicted seconds of ``chunk``'s all-reduce: the profile times the median ratio of
        observed to profiled time of the last lone chunks (at least 1); None without a profile."""
        base = self._profiled(chunk)
        return None if base is None else self._scale() * base

    def _profiled(self, chunk: Chunk) -> float | None:
        if self._profile is None:
            return None
        alpha, beta = self._profile
        return alpha + chunk.numel * chunk.dtype.itemsize / beta

    def _scale(self) -> float:
        ratios = sorted(self._ratios)
        return max(1.0, ratios[len(ratios) // 2]) if ratios else 1.0

    def _fits(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` may go now under the window (priority on): it must end before the
        next a2a's expected start; without a prediction it waits."""
        if not self._priority or self.window_until is None:
            return True
        predicted = self.predict(chunk)
        return predicted is not None and time.perf_counter() + predicted <= self.window_until

    def _pump(self) -> None:
        """Reap finished chunks, then launch ready ones in order while the gate and window allow."""
        while self._inflight and self._inflight[0].work.is_completed():
            self._finish(self._inflight.popleft())
        while (
            not self._learn  # the order is agreed at the flush, before any chunk goes
            and self._next < len(self.chunks)
            and self._missing[self._next] == 0
            and not self.gated
            and (self._max_inflight is None or len(self._inflight) < self._max_inflight)
            and self._fits(self.chunks[self._next])
        ):
            self._launch(self.chunks[self._next])
            self._next += 1

    def _launch(self, chunk: Chunk) -> None:
        parts = []
        for s in chunk.segments:
            grad = self._params[s.param].grad
            assert grad is not None, "a ready parameter has a gradient"
            parts.append(grad.detach().reshape(-1)[s.start : s.stop])
        flat = torch.cat(parts)  # a copy: the local gradient stays intact until the result lands
        event = Event("chunk", chunk.index, time.perf_counter(), alone=not self._inflight)
        if self._priority and self.window_until is not None:
            event.deadline, event.predicted = self.window_until, self.predict(chunk)
        work = dist.all_reduce(flat, group=self._group, async_op=True)
        assert work is not None
        # Issued now: on an emulated device the issue first finishes the compute before it.
        event.t_launch = time.perf_counter()
        try:  # the completion time, from the communication thread (a plain float store)
            work.get_future().then(lambda _: _stamp(event))
        except RuntimeError:  # a backend without futures: completion as observed
            pass
        self.events.append(event)
        self.collectives.append(("all_reduce", chunk.index, chunk.numel))
        self._inflight.append(_InFlight(chunk, work, flat, event))

    def _finish(self, entry: _InFlight) -> None:
        entry.work.wait()
        event = entry.event
        if event.t_done is None:
            event.t_done = time.perf_counter()
        base = self._profiled(entry.chunk)
        if event.alone and base is not None and base > 0:  # how far off the profile really is
            self._ratios.append((event.t_done - event.t_launch) / base)
        flat = entry.flat
        if self._divisor is not None and self._divisor != 1:
            flat.div_(self._divisor)  # our own buffer (torch.cat made it)
        offset = 0
        for s in entry.chunk.segments:
            grad = self._params[s.param].grad
            assert grad is not None
            n = s.stop - s.start
            grad.view(-1)[s.start : s.stop].copy_(flat[offset : offset + n])
            offset += n

    @contextmanager
    def a2a(self, group: ProcessGroup | None = None) -> Iterator[Event]:
        """Gate one all-to-all: no chunk launches (priority on) until the block exits.

        Open it when the a2a becomes pending and close it after its handle is waited. ``group``
        (optional) is the a2a's group, checked to differ from the gradient group.
        """
        event = Event("a2a", self._a2a_count, time.perf_counter())
        self.open_a2a(group)
        self._a2a_count += 1
        self.events.append(event)
        try:
            yield event
        finally:
            event.t_done = time.perf_counter()
            self.close_a2a()

    def open_a2a(self, group: ProcessGroup | None = None) -> None:
        """Open the gate for an a2a that is pending now (the explicit form of :meth:`a2a`, for
        a span that crosses function boundaries, such as autograd's backward); unlogged."""
        if group is not None and group is self._group:
            raise ValueError("the a2a must run on a different process group than the gradients")
        self._open_a2a += 1

    def close_a2a(self) -> None:
        """Close one gate opened by :meth:`open_a2a`; queued chunks may launch now."""
        if self._open_a2a <= 0:
            raise RuntimeError("close_a2a() without an open a2a")
        self._open_a2a -= 1
        self._closings += 1
        self._pump()

    def clear_log(self) -> None:
        """Forget the logged events and collectives (a new step's log starts empty)."""
        self.events.clear()
        self.collectives.clear()

    def flush(self) -> None:
        """Zero-fill missing gradients, launch every remaining chunk in order, wait for all."""
        self.launch_rest()
        self.wait_all()

    def launch_rest(self) -> None:
        """The first half of :meth:`flush`: zero-fill missing gradients and launch chunks in
        order up to the window (no a2a is ahead: the gap window no longer applies), so that
        several reducers' flushes can be on the wire together."""
        if self._open_a2a:
            raise RuntimeError("flush() inside an open a2a: close it first")
        for index, param in enumerate(self._params):
            if not self._ready[index]:
                if param.grad is None:
                    # No tokens reached this parameter here; other ranks may have a gradient.
                    param.grad = torch.zeros_like(param)
                self._mark_ready(index)
        if self._learn:
            self._adopt_order()
        self.window_until = None
        self._pump()

    @property
    def reduced(self) -> bool:
        """Whether, inside a flush (after :meth:`launch_rest`), every chunk has been launched
        and waited: the gradients of :attr:`parameters` hold their final values."""
        return all(self._ready) and not self._inflight and self._next >= len(self.chunks)

    @property
    def group(self) -> ProcessGroup:
        """The gradient group this reducer all-reduces over."""
        return self._group

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients this reducer reduces, in its order."""
        return list(self._params)

    def oldest_launch(self) -> float | None:
        """Launch time of this reducer's oldest chunk on the wire; None when none is."""
        return self._inflight[0].event.t_launch if self._inflight else None

    def wait_oldest(self) -> None:
        """One step of a flush shared by several reducers (after :meth:`launch_rest`): wait
        for the oldest chunk on the wire, then launch the next ones up to ``max_inflight``."""
        if self._inflight:
            self._finish(self._inflight.popleft())
        while self._next < len(self.chunks) and (
            self._max_inflight is None or len(self._inflight) < self._max_inflight
        ):
            self._launch(self.chunks[self._next])
            self._next += 1

    def wait_all(self) -> None:
        """The second half of :meth:`flush`: launch what the window held, wait for every chunk."""
        while self._next < len(self.chunks):
            if self._max_inflight is not None and len(self._inflight) >= self._max_inflight:
                self._finish(self._inflight.popleft())
            self._launch(self.chunks[self._next])
            self._next += 1
        while self._inflight:
            self._finish(self._inflight.popleft())
        self._reset()

    def _adopt_order(self) -> None:
        """Re-plan the chunks in the order and phases of this backward's gradients on the
        group's first rank (``learn_order``, once, in the first flush, before any chunk of the
        group was launched: one broadcast on the gradient group, on every rank alike).
        Parameters that got no gradient from a hook there follow in the default order, in the
        last phase seen. Every chunk is ready (the flush marked every parameter)."""
        self._learn = False
        count = len(self._params)
        if count == 0:
            return
        phase_of = dict(reversed(self._arrivals))  # a parameter's first arrival
        seen = list(dict.fromkeys(index for index, _ in self._arrivals))
        last = max(phase_of.values(), default=0)
        walk = seen + [i for i in reversed(range(count)) if i not in phase_of]
        learnt = torch.tensor(
            [walk, [phase_of.get(i, last) for i in range(count)]], dtype=torch.int64
        )
        broadcast_anywhere(learnt, dist.get_global_rank(self._group, 0), self._group)
        order, phases = learnt.tolist()
        numels, dtypes = [p.numel() for p in self._params], [p.dtype for p in self._params]
        size = self._size_for(numels, dtypes, order, phases)
        chunks = plan_chunks(numels, dtypes, size, order, phases)
        self._order = order
        self._plan(chunks)
        self._missing = [0] * len(chunks)

    @property
    def learnt_order(self) -> list[int] | None:
        """The parameter order agreed at the first flush (``learn_order``; None before, and
        after :meth:`rebind`), which the chunks follow."""
        return None if self._order is None else list(self._order)

    def _plan(self, chunks: tuple[Chunk, ...]) -> None:
        """Use ``chunks`` (over ``self._params``) from the next backward on."""
        self.chunks = chunks
        self._chunks_of = [[] for _ in self._params]
        for chunk in self.chunks:
            for param in chunk.params:
                self._chunks_of[param].append(chunk.index)

    def remove(self) -> None:
        """Remove the gradient hooks (the reducer stops acting on later backwards)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def rebind(self, params: Sequence[nn.Parameter]) -> None:
        """Reduce ``params`` from the next backward on, with the same group and settings
        (expert re-placement, moe/replace.py). Between steps only: nothing in flight. Chunks
        are re-planned from the new shapes, so every rank of the group must rebind to
        parameters of the same shapes in the same order (replicas hold the same experts)."""
        if self._inflight or self.touched:
            raise RuntimeError("ChunkedGradReducer.rebind: between steps only (after the flush)")
        self.remove()
        self._params = list({id(p): p for p in params if p.requires_grad}.values())
        self._order = None  # new parameters: the default order (a learnt one is re-learnt)
        self._learn = self._learn_order
        self._plan(self._default_chunks())
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._reset()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self._params)
        ]
