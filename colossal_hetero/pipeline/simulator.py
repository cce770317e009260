"""Event-driven simulation of one pipeline step under a kFkB order. Pure.

Model (the contract the tuner and the planner rely on):

- Stage ``s`` runs its :func:`~colossal_hetero.pipeline.order.kfkb_order` one pass at a time;
  a forward takes ``forward_s[s]``, a backward ``backward_s[s]`` seconds.
- A forward on stage ``s > 0`` waits for micro-batch ``i``'s activation from stage ``s - 1``; a
  backward on stage ``s < p - 1`` waits for its gradient from stage ``s + 1``.
- Sends are non-blocking and receives are posted early: a finished pass queues its output on the
  boundary link at once and the sender goes on computing; the receiver finds the data there as
  soon as the transfer ends, busy or not.
- Boundary ``b`` (between stages ``b`` and ``b + 1``) carries one transfer at a time per
  direction, first in, first out. How long one micro-batch's transfer holds the link is a
  :class:`Trace`: piecewise constant in time, so a transfer that straddles a change speeds up or
  slows down part-way (it progresses at ``1 / seconds`` of a transfer per second). Activations
  and gradients may have their own traces (a tenant that loads one stage's download slows the
  messages into that stage only). An optional latency per boundary and direction is added
  after the transfer leaves the link (or port): latency overlaps with the next transfer, link
  time does not (alpha and bytes / bandwidth of the alpha-beta model; also a queue behind other
  traffic, which messages on their way at the same time wait out together).
- ``shared_ports``: each stage has one network port, an upload and a download, as a rank with
  one network interface. A middle stage's upload carries both its activations (to ``s + 1``)
  and its gradients (to ``s - 1``), first in, first out in the order they were sent; its
  download both kinds it receives. A message holds its sender's upload for its transfer time,
  and streams into the receiver's download as it leaves the upload (packets are forwarded as
  they come): it lands at ``max(off the upload, start on the download + transfer time)``,
  the download starting no earlier than the upload. Two stages (``p = 2``) give the same
  times as separate links: each port then carries one kind of message.
- ``burst_s`` / ``up_burst_s``: a link or port shaped by a token bucket (tc's htb ``burst``)
  lets a message through that many seconds faster after it idled: tokens accrue at the link's
  rate up to the bucket, so a message that finds the link (or port) idle for ``g`` seconds moves
  as if it had started ``min(burst, g)`` earlier (back-to-back messages get no credit). Through
  two shaped ports in series (upload, then download) the smaller credit counts. Exact for
  messages at least as large as the bucket; the step's first messages (timed whole) get none.
- ``token_debt``: the shaper charges a message after letting it through (tc htb sends a packet
  whenever its bucket is not empty and lets the tokens go negative, and a 16 KiB message leaves
  as one GSO packet): a message lands as soon as it starts on its link (or, with shared ports,
  as soon as the receiver's download starts it), and the link (port) stays closed for its
  transfer time less its credit, until the debt is paid. Back-to-back messages still land one
  transfer time apart; a lone one arrives at once (PP=4 on 20 Mbit/s links, 16 KiB messages:
  lone ones landed 0-3 ms after their send, queued ones 6.6 ms apart). First messages (timed
  whole) land at their end as without it.
- ``jitter_s`` (session 10): of each pass's seconds on stage ``s``, ``jitter_s[s]`` on average
  come in jumps: a pass descheduled by the host's scheduler (4 ranks on 2 cores) loses a slice
  of :data:`DESCHEDULE_S` to another rank. Passes take ``seconds - jitter_s[s]``, and a share
  ``q = jitter_s[s] / DESCHEDULE_S`` of them (spread evenly: pass ``n`` jumps when ``n q`` plus
  the stage's phase crosses an integer; phases golden-ratio apart) take a slice more, so the
  mean stays. Deterministic, one simulation. Constant passes under-predict 1F1B, whose every
  pass waits on a neighbour: a late pass on one stage delays the others (PP=4, 20 Mbit/s, load
  2-4: k = 1 -5.5% median over 12 steps, +4% with it; k = 4, which buffers, -2.4% either way).
- ``first_early`` (session 14): the step's first message of each kind and boundary had its
  receive posted as the step started (``KFKBSchedule`` from its second step on: the receiver
  keeps the last step's metadata, ``pipeline/p2p.py``), so it moves when sent, as any other;
  no later message of its kind moves before the receiver asks for the first (their receives
  are posted when it reads the first one's header). Without it, with ``first_s``, the first
  message itself also waits for that ask (the metadata read before its receives are posted).
- Memory: a micro-batch's activations live on stage ``s`` from its forward to its backward;
  peak memory is ``activation_bytes[s]`` times the peak number alive.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from colossal_hetero.pipeline.order import Step, kfkb_order, peak_in_flight

DESCHEDULE_S = 0.006
"""Seconds a descheduled pass loses (``jitter_s``): one slice of the kernel's scheduler period
(about 12 ms on 2 cores) shared by two runnable ranks per core; PP=4 passes on 2 cores ran
6-12 ms over their median when they were descheduled."""
GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True, slots=True)
class Trace:
    """Seconds one micro-batch transfer takes, as a step function of the wall-clock time.

    ``seconds[j]`` holds from ``starts[j]`` until ``starts[j + 1]`` (the last value forever).
    ``starts[0]`` must be 0. A value of 0 means transfers are free.
    """

    starts: tuple[float, ...] = (0.0,)
    seconds: tuple[float, ...] = (0.0,)

    def __post_init__(self) -> None:
        if len(self.starts) != len(self.seconds) or not self.starts or self.starts[0] != 0.0:
            raise ValueError("trace: starts and seconds must be equally long, starting at 0")
        if any(b <= a for a, b in zip(self.starts, self.starts[1:], strict=False)):
            raise ValueError(f"trace: starts must increase, got {self.starts}")
        if any(not (math.isfinite(c) and c >= 0) for c in self.seconds):
            raise ValueError(f"trace: seconds must be finite and >= 0, got {self.seconds}")

    @classmethod
    def constant(cls, seconds: float) -> Trace:
        """The same transfer time at every moment."""
        return cls((0.0,), (float(seconds),))

    def finish(self, start: float) -> float:
        """When a transfer started at ``start`` ends (before 0: at the first value)."""
        if len(self.seconds) == 1:  # constant (the tuner's traces): the loop's first return
            return start + self.seconds[0]
        j = max(0, bisect.bisect_right(self.starts, start) - 1)
        t, left = start, 1.0  # fraction of the transfer still to move
        while True:
            c = self.seconds[j]
            end = self.starts[j + 1] if j + 1 < len(self.starts) else math.inf
            if c == 0.0 or t + left * c <= end:
                return t + left * c
            left -= (end - t) / c
            t, j = end, j + 1


@dataclass(frozen=True, slots=True)
class Event:
    """One pass on one stage, for plots: ``op`` of micro-batch ``mb`` ran over [start, end)."""

    stage: int
    op: str
    mb: int
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class SimResult:
    """Outcome of one simulated step; times in seconds from the step's start."""

    step_time: float
    busy: tuple[float, ...]
    """Seconds each stage computed."""
    idle: tuple[float, ...]
    """``step_time - busy`` per stage."""
    peak_in_flight: tuple[int, ...]
    peak_memory: tuple[float, ...]
    """Bytes of live activations at the peak, per stage."""
    events: tuple[Event, ...] = field(repr=False)


def _check_lengths(
    p: int,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    transfers: Sequence[Trace],
    activation_bytes: Sequence[float],
) -> None:
    if len(forward_s) != p or len(backward_s) != p or len(activation_bytes) != p:
        raise ValueError("simulate: forward_s, backward_s, activation_bytes need one entry a stage")
    if len(transfers) != p - 1:
        raise ValueError(f"simulate: {p} stages need {p - 1} boundary traces, got {len(transfers)}")


def _per_boundary(name: str, values: Sequence[float] | None, p: int) -> list[float]:
    """``values`` (default: 0 on every boundary) checked as ``p - 1`` finite seconds >= 0."""
    if values is None:
        return [0.0] * (p - 1)
    if len(values) != p - 1 or any(not (math.isfinite(x) and x >= 0) for x in values):
        raise ValueError(f"simulate: {name} needs {p - 1} finite values >= 0, got {values}")
    return [float(x) for x in values]


def simulate(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    transfers: Sequence[Trace],
    num_microbatches: int,
    k: int,
    activation_bytes: Sequence[float] | None = None,
    start_time: float = 0.0,
    latency_s: Sequence[float] | None = None,
    up_transfers: Sequence[Trace] | None = None,
    up_latency_s: Sequence[float] | None = None,
    shared_ports: bool = False,
    first_s: Sequence[float] | None = None,
    first_up_s: Sequence[float] | None = None,
    burst_s: Sequence[float] | None = None,
    up_burst_s: Sequence[float] | None = None,
    keep_events: bool = True,
    token_debt: bool = False,
    jitter_s: Sequence[float] | None = None,
    first_early: bool = False,
) -> SimResult:
    """Simulate one step of kFkB with ``k`` over ``p = len(forward_s)`` stages.

    ``transfers[b]`` is boundary ``b``'s trace for activations (stage ``b`` to ``b + 1``),
    ``up_transfers[b]`` for gradients (default: the same traces), each evaluated at
    ``start_time`` plus the simulated time (so successive steps can walk along one trace).
    ``latency_s[b]`` (default 0) is added to every landing on boundary ``b``, ``up_latency_s[b]``
    (default: ``latency_s``) to the gradients' instead; ``shared_ports``: see the module doc.
    ``first_s[b]`` / ``first_up_s[b]`` (default: none): seconds the step's first activation /
    gradient on boundary ``b`` takes, counted from when its receiver asks for it; no message
    of that kind moves before (see the module doc); ``first_up_s`` defaults to ``first_s``.
    ``burst_s[b]`` / ``up_burst_s[b]`` (default 0, gradients' ``burst_s``): token-bucket credit.
    ``keep_events=False`` leaves ``events`` empty (the same times, less work: the tuner's);
    ``token_debt``: messages land when they start and pay their transfer time after.
    ``jitter_s[s]`` (default 0): seconds of stage ``s``'s mean pass in jumps (module doc).
    ``first_early``: each kind's first message moves when sent (module doc; no ``first_s``)."""
    p = len(forward_s)
    act = [0.0] * p if activation_bytes is None else list(activation_bytes)
    _check_lengths(p, forward_s, backward_s, transfers, act)
    up = list(transfers) if up_transfers is None else list(up_transfers)
    if len(up) != p - 1:
        raise ValueError(f"simulate: {p} stages need {p - 1} up_transfers, got {len(up)}")
    lat = _per_boundary("latency_s", latency_s, p)
    up_lat = lat if up_latency_s is None else _per_boundary("up_latency_s", up_latency_s, p)
    orders = [kfkb_order(p, s, num_microbatches, k) for s in range(p)]
    first = {} if first_early else _first_times(first_s, first_up_s, p)
    links = _Links(transfers, up, (lat, up_lat), shared_ports, start_time, first)
    links.hold = bool(first) or first_early
    links.burst, links.debt = _bursts(burst_s, up_burst_s, p), token_debt
    events: list[Event] | None = [] if keep_events else None
    step, busy = _run(orders, _Passes(forward_s, backward_s, jitter_s), links, start_time, events)
    peaks = tuple(peak_in_flight(o) for o in orders)
    return SimResult(
        step_time=step,
        busy=busy,
        idle=tuple(step - b for b in busy),
        peak_in_flight=peaks,
        peak_memory=tuple(n * a for n, a in zip(peaks, act, strict=True)),
        events=tuple(events or ()),
    )


def _bursts(
    burst_s: Sequence[float] | None, up_burst_s: Sequence[float] | None, p: int
) -> dict[str, list[float]]:
    """Each direction's token-bucket credit per boundary (gradients default to activations')."""
    burst = _per_boundary("burst_s", burst_s, p)
    return {
        "F": burst,
        "B": burst if up_burst_s is None else _per_boundary("up_burst_s", up_burst_s, p),
    }


def _first_times(
    first_s: Sequence[float] | None, first_up_s: Sequence[float] | None, p: int
) -> dict[tuple[str, int], float]:
    """Seconds of each (kind, boundary)'s first message (empty: no first messages)."""
    first: dict[tuple[str, int], float] = {}
    for op, times in (("F", first_s), ("B", first_s if first_up_s is None else first_up_s)):
        if times is not None:
            first.update({(op, b): x for b, x in enumerate(_per_boundary("first_s", times, p))})
    return first


class _Links:
    """When each sent message lands: per-direction FIFO links, or shared stage ports."""

    def __init__(
        self,
        down: Sequence[Trace],
        up: Sequence[Trace],
        latency: tuple[Sequence[float], Sequence[float]],
        shared_ports: bool,
        start_time: float,
        first: dict[tuple[str, int], float],
    ) -> None:
        self.traces = {"F": list(down), "B": list(up)}
        self.first = {key: Trace.constant(x) for key, x in first.items()}
        """Each (kind, boundary)'s first message's time, which moves when asked for."""
        self.latency = {"F": list(latency[0]), "B": list(latency[1])}
        """Seconds each kind's messages take after leaving the link, per boundary."""
        self.burst = {"F": [0.0] * len(down), "B": [0.0] * len(up)}
        """Token-bucket credit of each kind's messages, per boundary (seconds)."""
        self.shared = shared_ports
        self.hold = bool(first)
        """Whether a kind's messages after its first wait for the receiver's first ask (the
        first one too unless ``first_early``: then ``first`` is empty)."""
        self.debt = False
        """Whether a message lands when it starts and its link closes for its time after."""
        self.free: dict[tuple[str, int], float] = {}
        """When each link or port is next free; idle (a full bucket) before its first message."""
        self.start = start_time

    def _begin(self, port: tuple[str, int], ready: float, burst: float) -> tuple[float, float]:
        """(when a message ready at ``ready`` starts on ``port``, its token-bucket credit)."""
        free = self.free.get(port, -math.inf)
        begin = max(ready, free, self.start)
        return begin, min(burst, begin - free)

    def land(self, op: str, src: int, dst: int, ready: float, first: bool = False) -> float:
        """Book the message ``src -> dst`` of kind ``op`` sent at ``ready``; its landing time.
        Calls must come in order of ``ready`` (the FIFO order of every link and port).
        ``first``: the step's first message of its kind and boundary (``self.first``), timed
        whole: no token-bucket credit."""
        boundary = min(src, dst)
        if first:
            trace, burst = self.first[(op, boundary)], 0.0
        else:
            trace, burst = self.traces[op][boundary], self.burst[op][boundary]
        debt = self.debt and not first
        if not self.shared:
            begin, credit = self._begin((op, boundary), ready, burst)
            leaves = max(begin, trace.finish(begin - credit))
            self.free[(op, boundary)] = leaves
            leaves = begin if debt else leaves
        else:
            begin, credit = self._begin(("up", src), ready, burst)
            sent = max(begin, trace.finish(begin - credit))  # off the sender's port
            down, credit = self._begin(("down", dst), begin, burst)
            leaves = max(down, trace.finish(down - credit))
            leaves = leaves if debt else max(sent, leaves)
            self.free[("up", src)], self.free[("down", dst)] = sent, leaves
            leaves = down if debt else leaves
        return leaves + self.latency[op][boundary]


def _jitter(
    jitter_s: Sequence[float] | None, forward_s: Sequence[float], backward_s: Sequence[float]
) -> list[float]:
    p = len(forward_s)
    if jitter_s is None:
        return [0.0] * p
    pairs = zip(jitter_s, forward_s, backward_s, strict=False)
    if len(jitter_s) != p or any(not (0 <= j <= min(f, b)) for j, f, b in pairs):
        raise ValueError(
            f"simulate: jitter_s needs {p} values in [0, min(forward, backward)], got {jitter_s}"
        )
    return [float(j) for j in jitter_s]


class _Passes:
    """Each stage's pass seconds in the order it runs them: constant, or with ``jitter`` its
    mean less the jitter and, on an evenly spread share of passes, a descheduling jump."""

    def __init__(
        self,
        forward_s: Sequence[float],
        backward_s: Sequence[float],
        jitter_s: Sequence[float] | None,
    ) -> None:
        self.seconds = {"F": forward_s, "B": backward_s}
        self.jitter = _jitter(jitter_s, forward_s, backward_s)
        self.count = [0] * len(forward_s)

    def next(self, s: int, op: str) -> float:
        seconds, jitter = self.seconds[op][s], self.jitter[s]
        if jitter <= 0:
            return seconds
        share = min(1.0, jitter / DESCHEDULE_S)
        n, phase = self.count[s], ((s + 1) * GOLDEN) % 1.0
        self.count[s] += 1
        jumps = math.floor((n + 1) * share + phase) - math.floor(n * share + phase)
        return seconds - jitter + jumps * jitter / share


def _run(
    orders: list[list[Step]],
    passes: _Passes,
    links: _Links,
    start_time: float,
    events: list[Event] | None,
) -> tuple[float, tuple[float, ...]]:
    """Event loop in time order: a pass ends, its output is booked on the links (in send order),
    a landing may start a pass. Returns the last pass's end and each stage's seconds computing
    (summed in pass order); appends each pass to ``events`` unless None."""
    p, arrival = len(orders), dict[tuple[int, str, int], float]()
    held, asked = dict[tuple[int, str], list[int]](), set[tuple[int, str]]()  # held: sent early
    pos, busy, computed, last = [0] * p, [False] * p, [0.0] * p, [0.0]
    heap: list[tuple[float, int, int, str, int]] = []  # (time, seq, stage, op or "", mb)

    def try_start(s: int, now: float) -> None:
        if busy[s] or pos[s] == len(orders[s]):
            return
        op, mb = orders[s][pos[s]]
        needs_input = (op == "F" and s > 0) or (op == "B" and s < p - 1)
        if needs_input and links.hold and (s, op) not in asked:  # the first of its kind
            asked.add((s, op))  # asked for: the receives held back are posted now
            for sent_mb in held.pop((s, op), []):
                book(op, s + 1 if op == "B" else s - 1, s, now, sent_mb)
        if needs_input and arrival.get((s, op, mb), math.inf) > now:
            return
        end = now + passes.next(s, op)
        began, ended = now - start_time, end - start_time
        computed[s] += ended - began
        last[0] = max(last[0], ended)  # passes end at >= 0: as the max over the events
        if events is not None:
            events.append(Event(s, op, mb, began, ended))
        busy[s], pos[s] = True, pos[s] + 1
        heapq.heappush(heap, (end, next(seq), s, op, mb))

    def book(op: str, src: int, dest: int, now: float, mb: int) -> None:
        # None of a kind moves before its receiver asks for the first (receives posted then),
        # but the first itself when its receive was posted early.
        early = not links.first and mb == 0
        if links.hold and (dest, op) not in asked and not early:
            held.setdefault((dest, op), []).append(mb)
            return
        first = bool(links.first) and mb == 0
        arrival[(dest, op, mb)] = landed = links.land(op, src, dest, now, first)
        heapq.heappush(heap, (landed, next(seq), dest, "", mb))

    seq = itertools.count()  # ties in time go in the order they were booked
    for s in range(p):
        try_start(s, start_time)
    while heap:
        now, _, s, op, mb = heapq.heappop(heap)
        if op:  # a pass ended on stage s ("": a message landed there)
            busy[s] = False
            dest = s + 1 if op == "F" else s - 1
            if 0 <= dest < p:
                book(op, s, dest, now, mb)
        try_start(s, now)
    assert pos == [len(o) for o in orders], f"simulated pipeline deadlocked at {pos}"
    return last[0], tuple(computed)
