"""How much of each stage-boundary message every tensor-parallel link carries. Pure (no torch).

Under 1D tensor parallelism every TP rank of a stage holds the same hidden states, and kFkB
sends each message in pieces, one per TP link (``pipeline/p2p.py``'s ``TPSlice``: TP rank ``t``
of stage ``s`` to TP rank ``t`` of stage ``s + 1``), which the receiving stage gathers over its
fast TP group. Equal pieces make a message as slow as its slowest link: when another tenant
takes 85% of one rank's download, the whole boundary runs at that link's leftover rate while
the other links idle. Here the pieces follow the links' measured speeds instead.

A message is split into ``QUANTUM`` units; link ``t`` carries ``units[t]`` of them
(:func:`piece_bounds`), at least ``FLOOR_UNITS`` each, so every link keeps carrying data and
its time stays measured (a link that carried nothing could not be seen to recover).
:func:`balanced_units` places the units so that the slowest link finishes first: the least
``max_t units[t] * seconds_per_unit[t]``. :func:`next_units` turns one step's measured link
times into the next units, with the estimates it keeps between steps; every rank calls it on
the same gathered measurements, so every rank reaches the same units without a broadcast.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from colossal_hetero.pipeline.links import column_link_seconds, landed_within
from colossal_hetero.pipeline.tuner import PipelineProfile

if TYPE_CHECKING:
    from colossal_hetero.pipeline.profile import RankRecord

QUANTUM = 16
"""Units of one message: a link's share moves in steps of 1/16."""
FLOOR_UNITS = 1
"""Least units of a message on any link: its time stays measured (see the module doc)."""


def piece_bounds(numel: int, units: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` of each link's piece of a flattened message of ``numel`` elements.

    Piece ``t`` ends at ``numel * (units[0] + ... + units[t]) // sum(units)``: the pieces tile
    the message in order, each within one element of its share. Both ends compute the same
    bounds. Raises ValueError when a unit is below 1 or ``numel`` is below ``sum(units)`` (a
    piece could be empty)."""
    total = sum(units)
    if not units or min(units) < 1:
        raise ValueError(f"units: every link needs at least one unit, got {tuple(units)}")
    if numel < total:
        raise ValueError(f"numel: {numel} elements cannot fill {total} units")
    bounds, start, acc = [], 0, 0
    for u in units:
        acc += u
        stop = numel * acc // total
        bounds.append((start, stop))
        start = stop
    return bounds


def balanced_units(
    seconds_per_unit: Sequence[float],
    latency_s: Sequence[float] | None = None,
    quantum: int = QUANTUM,
    floor: int = FLOOR_UNITS,
) -> tuple[int, ...]:
    """Units per link summing to ``quantum`` that land a message's last piece soonest.

    Link ``t`` lands its piece ``latency_s[t] + units[t] * seconds_per_unit[t]`` after the
    message is sent. Every link starts at ``floor``; each further unit goes to the link that
    would land soonest with it (ties to the lower index). For costs increasing in the units this
    greedy choice minimises the largest cost (each unit goes where it raises the running
    maximum least). Raises ValueError on a negative or non-finite time, or when ``quantum``
    cannot give every link ``floor``."""
    n = len(seconds_per_unit)
    latency = [0.0] * n if latency_s is None else list(latency_s)
    if n == 0 or floor < 1 or quantum < n * floor or len(latency) != n:
        raise ValueError(f"quantum: {quantum} units cannot give {n} links {floor} each")
    if any(not math.isfinite(s) or s < 0 for s in (*seconds_per_unit, *latency)):
        raise ValueError(f"seconds_per_unit: need finite times >= 0, got {seconds_per_unit}")
    units = [floor] * n
    for _ in range(quantum - n * floor):
        best = min(range(n), key=lambda t: (latency[t] + (units[t] + 1) * seconds_per_unit[t], t))
        units[best] += 1
    return tuple(units)


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    """What a link is believed to cost: seconds per unit of a message, and latency."""

    seconds_per_unit: float
    latency_s: float = 0.0

    def lands_s(self, units: int) -> float:
        """Seconds from a piece of ``units`` being sent to its landing."""
        return self.latency_s + units * self.seconds_per_unit


def slowest_s(units: Sequence[int], estimates: Sequence[LinkEstimate]) -> float:
    """When the last piece of one message carried as ``units`` lands."""
    return max(e.lands_s(u) for u, e in zip(units, estimates, strict=True))


@dataclass(frozen=True, slots=True)
class LinkReading:
    """What one step showed of one link (one TP column of one direction of one boundary)."""

    units: int
    """Units of each message it carried in that step."""
    per_message_s: float
    """Seconds one message held it (``links.column_link_seconds``); 0: no receive waited."""
    latency_s: float = 0.0
    """Seconds its messages took beyond that (a queue ahead of the link)."""
    landed_within_s: float = math.inf
    """The least ``asked - released`` of its messages found landed when asked for: each took
    at most that long (inf: none found landed)."""


def estimate_link(reading: LinkReading, known: LinkEstimate | None) -> LinkEstimate | None:
    """A link's estimate after one step: measured when a receive waited for it; else the
    earlier estimate ``known`` with its seconds per unit lowered to what the landed messages
    bound (the link kept up: it carried its units in at most that); None when nothing is
    known yet. A link that kept up is not taken to be faster than that: with small pieces on
    a preempted link it keeps up without having recovered."""
    if reading.per_message_s > 0:
        return LinkEstimate(reading.per_message_s / reading.units, reading.latency_s)
    bound = reading.landed_within_s / reading.units
    if known is None:
        return LinkEstimate(bound) if math.isfinite(bound) else None
    return LinkEstimate(min(known.seconds_per_unit, bound), known.latency_s)


def next_units(
    current: Sequence[int],
    readings: Sequence[LinkReading],
    known: Sequence[LinkEstimate | None],
    min_gain: float,
) -> tuple[tuple[int, ...], tuple[LinkEstimate | None, ...]]:
    """The units of one direction's links for the next steps, and the estimates to keep.

    ``current``: the units the links carry now (their sum is the quantum); ``readings``: one
    step's :class:`LinkReading` per link; ``known``: the estimates kept from earlier steps
    (None: unknown). The units move to :func:`balanced_units` of the estimates
    (:func:`estimate_link`) only when that is predicted to land a message more than
    ``min_gain`` sooner than ``current`` does (measured times jitter; a boundary whose units
    flapped would pay for it). While any link is unknown the units stay."""
    if not len(current) == len(readings) == len(known):
        raise ValueError("next_units: one current share, reading and estimate per link")
    kept = tuple(estimate_link(r, k) for r, k in zip(readings, known, strict=True))
    return choose_units(current, kept, min_gain), kept


def choose_units(
    current: Sequence[int], estimates: Sequence[LinkEstimate | None], min_gain: float
) -> tuple[int, ...]:
    """:func:`balanced_units` of ``estimates`` when they land a message more than ``min_gain``
    sooner than ``current``, else ``current`` (also while any link is unknown)."""
    known = [e for e in estimates if e is not None]
    if len(known) < len(estimates):
        return tuple(current)
    proposal = balanced_units(
        [e.seconds_per_unit for e in known], [e.latency_s for e in known], quantum=sum(current)
    )
    if slowest_s(proposal, known) < (1.0 - min_gain) * slowest_s(current, known):
        return proposal
    return tuple(current)


def median_estimates(
    window: Sequence[Sequence[LinkEstimate | None]],
) -> tuple[LinkEstimate | None, ...]:
    """Per link, the median seconds per unit and the median latency of its known estimates in
    ``window`` (one tuple per step, oldest first); None when it has none. A lone step's odd
    reading (a receive that also waited for something else) then moves no units."""
    out: list[LinkEstimate | None] = []
    for per_step in zip(*window, strict=True):
        known = [e for e in per_step if e is not None]
        if not known:
            out.append(None)
            continue
        spu = statistics.median(e.seconds_per_unit for e in known)
        out.append(LinkEstimate(spu, statistics.median(e.latency_s for e in known)))
    return tuple(out)


Direction = tuple[str, int]
"""``("F", b)``: activations over boundary ``b`` (stage ``b`` to ``b + 1``); ``("B", b)``:
gradients back over it."""


def quantum_for(tp: int) -> int:
    """Units of a message split over ``tp`` links: :data:`QUANTUM` rounded up to a multiple of
    ``tp``, so that equal shares are whole units."""
    return tp * -(-QUANTUM // tp)


def even_units(tp: int) -> tuple[int, ...]:
    """Equal shares of ``tp`` links."""
    return (quantum_for(tp) // tp,) * tp


def step_readings(
    records: Sequence[RankRecord],
    tp_index_of_rank: Sequence[int],
    units: Mapping[Direction, Sequence[int]],
) -> dict[Direction, list[LinkReading]]:
    """One step's :class:`LinkReading` per TP link of each direction in ``units`` (the units
    that step ran with). A link is TP rank ``t`` of the upstream stage with its counterpart;
    with data parallelism several pipeline columns share ``t``, and the slowest of them speaks
    for it (largest times, least landed bound)."""
    seconds = column_link_seconds(records)
    landed = landed_within(records)
    upstream = {(r.stage, r.rank) for r in records if r.next_rank is not None}
    out: dict[Direction, list[LinkReading]] = {}
    for (op, b), counts in units.items():
        readings = []
        for t, u in enumerate(counts):
            ranks = [rank for st, rank in upstream if st == b and tp_index_of_rank[rank] == t]
            cols = [(op, b, rank) for rank in ranks]
            timed = [seconds.get(c, (0.0, 0.0)) for c in cols]
            readings.append(
                LinkReading(
                    units=u,
                    per_message_s=max((x for x, _ in timed), default=0.0),
                    latency_s=max((lat for _, lat in timed), default=0.0),
                    landed_within_s=min((landed.get(c, math.inf) for c in cols), default=math.inf),
                )
            )
        out[(op, b)] = readings
    return out


class LinkShareTuner:
    """Keeps each direction's units and link estimates across retunings (see the module doc).

    Every rank holds one and calls :meth:`decide` with the same gathered records, so every rank
    holds the same units: the caller applies them between steps on every rank
    (``KFKBSchedule.set_link_units``).
    """

    def __init__(
        self,
        num_stages: int,
        tp_index_of_rank: Sequence[int],
        tp: int,
        min_gain: float,
        window: int = 1,
        min_step_gain: float = 0.0,
    ) -> None:
        if tp < 2:
            raise ValueError(f"tp: link shares need a tensor-parallel group of >= 2, got {tp}")
        if window < 1:
            raise ValueError(f"window: need >= 1 steps, got {window}")
        self.tp_index_of_rank, self.min_gain = list(tp_index_of_rank), min_gain
        self.min_step_gain = min_step_gain
        directions = [(op, b) for b in range(num_stages - 1) for op in ("F", "B")]
        self.units: dict[Direction, tuple[int, ...]] = {d: even_units(tp) for d in directions}
        """The units decided last (what the next steps carry once applied)."""
        self.history: dict[Direction, deque[tuple[LinkEstimate | None, ...]]] = {
            d: deque(maxlen=window) for d in directions
        }
        """Each direction's per-link estimates of the last ``window`` measured steps."""

    def estimates(self, direction: Direction) -> tuple[LinkEstimate | None, ...]:
        """The estimates the units follow: per link, the median over the window."""
        history = self.history[direction]
        if not history:
            return (None,) * len(self.units[direction])
        return median_estimates(history)

    def decide(
        self,
        records: Sequence[RankRecord],
        ran: Mapping[Direction, Sequence[int]],
        step_gain: Callable[[Direction, float], float] | None = None,
    ) -> dict[Direction, tuple[int, ...]]:
        """The units after one measured step that ran with ``ran``; also kept as ``units``.

        Each link's estimate from this step (:func:`estimate_link`, a link that kept up
        starting from the window's median) joins the window, and each direction's units
        follow the window's medians (:func:`choose_units`). ``step_gain(direction, factor)``:
        the step's predicted relative gain when that direction's message times are scaled by
        ``factor`` (the new units' last landing over the running ones'); with it, new units
        must also gain ``min_step_gain`` of the step (links that keep up gain nothing)."""
        readings = step_readings(records, self.tp_index_of_rank, ran)
        for d, links in readings.items():
            known = self.estimates(d)
            step = tuple(estimate_link(r, k) for r, k in zip(links, known, strict=True))
            self.history[d].append(step)
            estimates = self.estimates(d)
            proposal = choose_units(self.units[d], estimates, self.min_gain)
            if proposal != self.units[d] and step_gain is not None:
                known_all = [e for e in estimates if e is not None]
                factor = slowest_s(proposal, known_all) / slowest_s(self.units[d], known_all)
                if step_gain(d, factor) <= self.min_step_gain:
                    continue
            self.units[d] = proposal
        return dict(self.units)

    def per_boundary(self) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """``(forward, backward)`` units per boundary, as ``set_link_units`` takes them."""
        bounds = sorted({b for _, b in self.units})
        return [self.units[("F", b)] for b in bounds], [self.units[("B", b)] for b in bounds]


def scaled_profile(
    profile: PipelineProfile, direction: Direction, factor: float
) -> PipelineProfile:
    """``profile`` with one direction's per-message and latency seconds on its boundary times
    ``factor`` (the other direction keeps its own, made explicit when the profile shared them)."""
    op, b = direction

    def scaled(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(v * factor if i == b else v for i, v in enumerate(values))

    n = len(profile.transfer_s)
    latency = profile.latency_s or (0.0,) * n
    up, up_latency = profile.transfer_up_s or profile.transfer_s, profile.latency_up_s or latency
    if op == "F":
        return replace(
            profile,
            transfer_s=scaled(profile.transfer_s),
            latency_s=scaled(latency),
            transfer_up_s=up,
            latency_up_s=up_latency,
        )
    return replace(profile, transfer_up_s=scaled(up), latency_up_s=scaled(up_latency))
