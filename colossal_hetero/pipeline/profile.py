"""A measured pipeline step as data, the stage profile it implies, and the simulator's
prediction of it. Pure (no torch): the Ada controller and the pipeline benchmark share it.

Each pipeline rank describes one step it ran as a :class:`RankRecord` (``KFKBSchedule``
measures one after every training step: ``schedule.last_record``). From the records of all
ranks :func:`profile_from_records` derives, per stage, the forward and backward seconds per
micro-batch and the activation bytes, and per boundary the seconds one message holds the link;
:func:`predict_from_records` simulates the step from that profile and compares it with the
measured step time.
The link times come from :func:`~colossal_hetero.pipeline.links.link_seconds`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from colossal_hetero.pipeline.links import NOT_BLOCKED, first_posted_early, link_seconds
from colossal_hetero.pipeline.tuner import PipelineProfile, simulate_profile

_SCALARS = (
    "forward_s",
    "backward_s",
    "step_s",
    "activation_bytes",
    "message_bytes",
    "overhead_s",
    "first_early",
)
_LISTS = (
    "sent_next",
    "arrived_prev",
    "posted_prev",
    "sent_prev",
    "arrived_next",
    "posted_next",
    "asked_prev",
    "asked_next",
)


@dataclass(frozen=True, slots=True)
class RankRecord:
    """What one pipeline rank measured in one training step (seconds, bytes, clock times)."""

    rank: int
    stage: int
    next_rank: int | None
    """Global rank of this rank's peer on the next stage (None on the last stage)."""
    forward_s: float
    """Median seconds of one forward pass, its sends issued (compute as the stage really ran;
    the median leaves out a pass that also waited for a later tensor-parallel peer)."""
    backward_s: float
    step_s: float
    """Wall seconds of the whole step's schedule on this rank."""
    activation_bytes: float
    """Most bytes autograd kept for one micro-batch's backward: one in-flight micro-batch."""
    message_bytes: float
    """Tensor bytes of one message to the next stage (0 on the last stage)."""
    sent_next: tuple[float, ...] = ()
    """Per message to the next stage, in order: when it went onto the link."""
    arrived_prev: tuple[float, ...] = ()
    """Per message from the previous stage: when it arrived, ``NOT_BLOCKED`` if not waited for."""
    posted_prev: tuple[float, ...] = ()
    """Per message from the previous stage: when its receive was posted."""
    sent_prev: tuple[float, ...] = ()
    arrived_next: tuple[float, ...] = ()
    posted_next: tuple[float, ...] = ()
    asked_prev: tuple[float, ...] = ()
    """Per message from the previous stage: when this rank asked for it (empty: not known)."""
    asked_next: tuple[float, ...] = ()
    overhead_s: float = 0.0
    """Seconds of the step in no pass and not blocked for a message: the schedule's own work
    between passes (taking inputs, keeping outputs, posting receives), spread over the passes
    by :func:`profile_from_records`."""
    first_early: float = 0.0
    """1 when this rank's first receives of the step were posted as it started and its
    senders' metadata was unchanged (``pipeline/p2p.py``): its first messages moved when sent."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe dict (lists for the timestamp tuples)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankRecord:
        """Inverse of :meth:`to_dict`."""
        values = dict(data)
        for name in _LISTS:
            values[name] = tuple(float(t) for t in values.get(name, ()))
        return cls(**values)

    def to_vector(self, num_microbatches: int) -> list[float]:
        """Fixed-width floats for an all-gather: the scalars, then the eight timestamp lists
        padded to ``num_microbatches`` with ``NOT_BLOCKED`` (see :func:`record_from_vector`)."""
        m = num_microbatches
        lists = [getattr(self, name) for name in _LISTS]
        if any(len(t) > m for t in lists):
            raise ValueError(f"num_microbatches: {m} is below a record's message count")
        nxt = -1.0 if self.next_rank is None else float(self.next_rank)
        head = [float(self.rank), float(self.stage), nxt]
        head += [float(getattr(self, name)) for name in _SCALARS]
        return head + [v for t in lists for v in (*t, *[NOT_BLOCKED] * (m - len(t)))]


def vector_width(num_microbatches: int) -> int:
    """Length of :meth:`RankRecord.to_vector` for ``num_microbatches``."""
    return 3 + len(_SCALARS) + len(_LISTS) * num_microbatches


def record_from_vector(vector: Sequence[float], num_microbatches: int) -> RankRecord:
    """Inverse of :meth:`RankRecord.to_vector` (padding, ``NOT_BLOCKED``, is dropped from the
    sent and posted lists; the arrived lists keep ``num_microbatches`` entries)."""
    m = num_microbatches
    if len(vector) != vector_width(m):
        raise ValueError(f"record vector: {len(vector)} values, need {vector_width(m)}")
    head = 3 + len(_SCALARS)
    lists = {
        name: tuple(vector[head + i * m : head + (i + 1) * m]) for i, name in enumerate(_LISTS)
    }
    for name in _LISTS:
        if not name.startswith("arrived"):
            lists[name] = tuple(t for t in lists[name] if t != NOT_BLOCKED)
    nxt = int(vector[2])
    values: dict[str, Any] = dict(zip(_SCALARS, (float(v) for v in vector[3:head]), strict=True))
    values.update(lists, rank=int(vector[0]), stage=int(vector[1]))
    return RankRecord(next_rank=None if nxt < 0 else nxt, **values)


def profile_from_records(
    records: Sequence[RankRecord],
    num_stages: int,
    memory_budget_bytes: Sequence[float] | None = None,
    shared_ports: bool = True,
) -> PipelineProfile:
    """The stage profile a step's records imply, identical for any order of the records.

    A rank's pass is its median compute plus its share of the step it spent in neither a
    median pass nor a blocked wait (:func:`_beyond_median_passes`). The ranks of one
    tensor-parallel group finish each pass together (its all-reduces), so the group's pass is
    its shortest rank's: the others also waited for that rank's input, which is the link's
    time, counted there (a tenant on one TP rank's link made its peer's median forward 62-76
    ms against 25-30). A stage takes its slowest group's pass (data-parallel replicas) and its
    largest activations; link times per boundary and direction are :func:`link_seconds`.
    ``memory_budget_bytes`` defaults to no limit. ``shared_ports`` (default: each rank has one
    network interface) goes into the profile for the simulator."""
    if len({r.rank for r in records}) != len(records):
        raise ValueError("records: one record per rank")
    members = [[r for r in records if r.stage == s] for s in range(num_stages)]
    if any(not m for m in members):
        raise ValueError(f"records: every stage 0..{num_stages - 1} needs a record")
    links, early = link_seconds(records, num_stages, shared_ports), first_posted_early(records)
    budgets = memory_budget_bytes or [math.inf] * num_stages

    def per_pass(r: RankRecord) -> float:  # a rank runs m forwards and m backwards
        passes = _pass_count(r)
        return _beyond_median_passes(r, passes) / (2 * passes)

    tp = _tp_width(records)

    def stage_pass(ranks: list[RankRecord], backward: bool) -> float:
        groups: dict[int, list[float]] = {}
        for r in ranks:
            seconds = (r.backward_s if backward else r.forward_s) + per_pass(r)
            groups.setdefault(r.rank // tp, []).append(seconds)
        return max(min(g) for g in groups.values())

    forward = tuple(stage_pass(m, False) for m in members)
    backward = tuple(stage_pass(m, True) for m in members)
    jitter = tuple(
        min(f, b, max(_pass_jitter(r) for r in m))
        for m, f, b in zip(members, forward, backward, strict=True)
    )
    return PipelineProfile(
        forward_s=forward,
        backward_s=backward,
        transfer_s=links["F"],
        activation_bytes=tuple(max(r.activation_bytes for r in m) for m in members),
        memory_budget_bytes=tuple(budgets),
        transfer_up_s=links["B"],
        shared_ports=shared_ports,
        first_transfer_s=() if early else links["F0"],
        first_transfer_up_s=() if early else links["B0"],
        first_posted_early=early,
        latency_s=links["LF"],
        latency_up_s=links["LB"],
        token_debt=any(links["D"]),
        jitter_s=jitter,
    )


def _beyond_median_passes(r: RankRecord, passes: int) -> float:
    """Seconds of ``r``'s step in neither a median pass nor a blocked wait: its ``overhead_s``
    (the schedule's work between passes) plus its passes' excess over their median (a pass
    descheduled on a loaded host, a slow first pass). Without the times asked (older records)
    the blocked waits are unknown: ``overhead_s`` alone."""
    outside = _outside_passes(r, passes)
    return r.overhead_s if outside is None else max(r.overhead_s, outside)


def _outside_passes(r: RankRecord, passes: int) -> float | None:
    """Seconds of ``r``'s step outside its ``passes`` median passes and its blocked waits
    (None without the times asked: the waits are unknown)."""
    asks = ((r.arrived_prev, r.asked_prev), (r.arrived_next, r.asked_next))
    blocked = 0.0
    for arrived, asked in asks:
        for j, a in enumerate(arrived):
            if a != NOT_BLOCKED:
                if j >= len(asked):
                    return None
                blocked += a - asked[j]
    return r.step_s - passes * (r.forward_s + r.backward_s) - blocked


def _pass_count(r: RankRecord) -> int:
    """Forward (and backward) passes ``r`` ran: its most messages of one kind (at least 1)."""
    lists = (r.sent_next, r.sent_prev, r.arrived_prev, r.arrived_next)
    return max(1, *(len(t) for t in lists))


def _pass_jitter(r: RankRecord) -> float:
    """Seconds per pass of ``r``'s passes' excess over their median (the simulator's
    ``jitter_s``): its step outside median passes and blocked waits, less the schedule's own
    work between passes (``overhead_s``, which every pass pays alike), over its passes."""
    passes = _pass_count(r)
    outside = _outside_passes(r, passes)
    return 0.0 if outside is None else max(0.0, outside - r.overhead_s) / (2 * passes)


def _tp_width(records: Sequence[RankRecord]) -> int:
    """Ranks per tensor-parallel group: the distance from a rank to its next-stage peer in
    Colossal-AI's dp-outer layout (``tuner.stage_of_rank``), where ``rank // tp`` names a
    rank's group; 1 (every rank its own group) when the records disagree on it."""
    gaps = {r.next_rank - r.rank for r in records if r.next_rank is not None}
    return gaps.pop() if len(gaps) == 1 and min(gaps) > 0 else 1


@dataclass(frozen=True, slots=True)
class Prediction:
    """The simulator's step time against the measured one."""

    predicted_s: float
    measured_s: float
    """The slowest rank's step time (the step ends when the last rank finishes)."""
    profile: PipelineProfile

    @property
    def relative_error(self) -> float:
        """``|predicted - measured| / measured``."""
        return abs(self.predicted_s - self.measured_s) / self.measured_s


def predict_from_records(
    records: Sequence[RankRecord | Mapping[str, Any]], num_microbatches: int, k: int
) -> Prediction:
    """Simulate the step the records describe (kFkB with ``k``; 1 is 1F1B) from its measured
    per-stage compute and per-boundary link times, and pair it with the measured step time.

    ``records``: one per pipeline rank of one step, as :class:`RankRecord` or its ``to_dict``
    (e.g. ``schedule.last_record`` gathered from every rank). Raises ValueError on records
    that do not cover every stage, or a ``k`` outside ``1..num_microbatches``.
    """
    recs = [r if isinstance(r, RankRecord) else RankRecord.from_dict(r) for r in records]
    if not recs:
        raise ValueError("records: need at least one")
    num_stages = max(r.stage for r in recs) + 1
    profile = profile_from_records(recs, num_stages)
    result = simulate_profile(profile, num_microbatches, k)
    return Prediction(result.step_time, max(r.step_s for r in recs), profile)
