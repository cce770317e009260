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
  slows down part-way (it progresses at ``1 / seconds`` of a transfer per second). An optional
  per-boundary latency is added after the transfer leaves the link: latency overlaps with the
  next transfer, link time does not (alpha and bytes / bandwidth of the alpha-beta model).
- Memory: a micro-batch's activations live on stage ``s`` from its forward to its backward;
  peak memory is ``activation_bytes[s]`` times the peak number alive.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from colossal_hetero.pipeline.order import Step, kfkb_order, peak_in_flight


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
        """When a transfer started at ``start`` ends."""
        j = bisect.bisect_right(self.starts, start) - 1
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


def simulate(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    transfers: Sequence[Trace],
    num_microbatches: int,
    k: int,
    activation_bytes: Sequence[float] | None = None,
    start_time: float = 0.0,
    latency_s: Sequence[float] | None = None,
) -> SimResult:
    """Simulate one step of kFkB with ``k`` over ``p = len(forward_s)`` stages.

    ``transfers[b]`` is boundary ``b``'s trace, evaluated at ``start_time`` plus the simulated
    time (so successive steps can walk along one trace). Both directions of a boundary follow the
    same trace (activations and their gradients have the same size) on separate queues.
    ``latency_s[b]`` (default 0) is added to every landing time on boundary ``b``.
    """
    p = len(forward_s)
    act = [0.0] * p if activation_bytes is None else list(activation_bytes)
    lat = [0.0] * (p - 1) if latency_s is None else list(latency_s)
    _check_lengths(p, forward_s, backward_s, transfers, act)
    if len(lat) != p - 1 or any(not (math.isfinite(x) and x >= 0) for x in lat):
        raise ValueError(f"simulate: latency_s needs {p - 1} finite values >= 0, got {lat}")
    orders = [kfkb_order(p, s, num_microbatches, k) for s in range(p)]
    arrival: dict[tuple[int, str, int], float] = {}  # (stage, op, mb) -> input ready
    link_free = {(b, d): start_time for b in range(p - 1) for d in "FB"}
    stage_free = [start_time] * p
    pos = [0] * p
    events: list[Event] = []
    while any(pos[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]) and _ready(orders[s][pos[s]], s, p, arrival):
                op, mb = orders[s][pos[s]]
                start = max(stage_free[s], arrival.get((s, op, mb), start_time))
                end = start + (forward_s[s] if op == "F" else backward_s[s])
                events.append(Event(s, op, mb, start - start_time, end - start_time))
                stage_free[s], pos[s], progressed = end, pos[s] + 1, True
                _send(op, mb, s, p, end, transfers, lat, link_free, arrival)
        assert progressed, f"simulated pipeline deadlocked at positions {pos}"
    step = max(stage_free) - start_time
    busy = tuple(sum(e.end - e.start for e in events if e.stage == s) for s in range(p))
    peaks = tuple(peak_in_flight(o) for o in orders)
    return SimResult(
        step_time=step,
        busy=busy,
        idle=tuple(step - b for b in busy),
        peak_in_flight=peaks,
        peak_memory=tuple(n * a for n, a in zip(peaks, act, strict=True)),
        events=tuple(events),
    )


def _ready(step: Step, s: int, p: int, arrival: dict[tuple[int, str, int], float]) -> bool:
    op, mb = step
    needs_input = (op == "F" and s > 0) or (op == "B" and s < p - 1)
    return not needs_input or (s, op, mb) in arrival


def _send(
    op: str,
    mb: int,
    s: int,
    p: int,
    end: float,
    transfers: Sequence[Trace],
    latency: Sequence[float],
    link_free: dict[tuple[int, str], float],
    arrival: dict[tuple[int, str, int], float],
) -> None:
    """Queue the output of pass (op, mb) on stage s on its link; record when it lands."""
    if op == "F" and s < p - 1:
        boundary, dest = s, s + 1
    elif op == "B" and s > 0:
        boundary, dest = s - 1, s - 1
    else:
        return
    begin = max(end, link_free[(boundary, op)])
    leaves = transfers[boundary].finish(begin)
    link_free[(boundary, op)] = leaves
    arrival[(dest, op, mb)] = leaves + latency[boundary]
