"""A measured pipeline step as data, the stage profile it implies, and the simulator's
prediction of it. Pure (no torch): the Ada controller and the pipeline benchmark share it.

Each pipeline rank describes one step it ran as a :class:`RankRecord` (``KFKBSchedule``
measures one after every training step: ``schedule.last_record``). From the records of all
ranks :func:`profile_from_records` derives, per stage, the forward and backward seconds per
micro-batch and the activation bytes, and per boundary the seconds one message holds the link;
:func:`predict_from_records` simulates the step from that profile and compares it with the
measured step time.

**Link time from timestamps.** A sender notes when each message went onto the link (its
``isend``s issued), a receiver when it posted each message's receive and when the message
arrived. The receiver knows the arrival only when it was blocked in ``wait()`` (the data was not
there yet: it returned on arrival); an arrival it did not wait for is recorded as ``-1``. A
message can move only once it is sent, its receive is posted and the message before it on the
link has landed, so one blocked receive gives one sample of the link time:
``arrived_j - max(sent_j, posted_j, arrived_{j-1})`` (the last term only when message
``j - 1``'s receive blocked too, else its arrival is unknown). The direction's link time is
the median sample (robust to the odd wait that blocked for other reasons), 0 when no
receive blocked (then the transfers were hidden: the link did not hold anyone up). A boundary's
time is the larger of its two directions (the simulator runs both on one trace). The times of
all ranks must be on one clock: ``time.time()``, which ranks on one host share exactly and
ranks on several hosts share to their clock synchronisation.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from colossal_hetero.pipeline.simulator import Trace, simulate
from colossal_hetero.pipeline.tuner import PipelineProfile

NOT_BLOCKED = -1.0
"""The arrival time recorded for a receive whose ``wait()`` found the data already there."""

_SCALARS = ("forward_s", "backward_s", "step_s", "activation_bytes", "message_bytes")
_LISTS = ("sent_next", "arrived_prev", "posted_prev", "sent_prev", "arrived_next", "posted_next")


@dataclass(frozen=True, slots=True)
class RankRecord:
    """What one pipeline rank measured in one training step (seconds, bytes, clock times)."""

    rank: int
    stage: int
    next_rank: int | None
    """Global rank of this rank's peer on the next stage (None on the last stage)."""
    forward_s: float
    """Mean seconds of one forward pass, its sends issued (compute as the stage really ran)."""
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
        """Fixed-width floats for an all-gather: the scalars, then the six timestamp lists
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


def direction_seconds(
    sent: Sequence[float], posted: Sequence[float], arrived: Sequence[float]
) -> float:
    """Link seconds of one boundary direction from its sender's and receiver's timestamps (see
    the module doc): median over the blocked receives of ``arrived_j - max(sent_j, posted_j)``,
    0 when none blocked."""
    samples = []
    for j, arrival in enumerate(arrived):
        if arrival != NOT_BLOCKED and j < len(sent) and j < len(posted):
            # FIFO on one link: message j also waits for message j - 1 to land (known only
            # when its receive blocked; receives posted far ahead make that wait the rule).
            before = arrived[j - 1] if j > 0 else NOT_BLOCKED
            samples.append(max(0.0, arrival - max(sent[j], posted[j], before)))
    return statistics.median(samples) if samples else 0.0


def boundary_seconds(sender: RankRecord, receiver: RankRecord) -> float:
    """Seconds one message holds the link between ``sender`` (stage s) and ``receiver`` (its
    next-stage peer): the slower of activations going down and gradients coming up."""
    down = direction_seconds(sender.sent_next, receiver.posted_prev, receiver.arrived_prev)
    up = direction_seconds(receiver.sent_prev, sender.posted_next, sender.arrived_next)
    return max(down, up)


def profile_from_records(
    records: Sequence[RankRecord],
    num_stages: int,
    memory_budget_bytes: Sequence[float] | None = None,
) -> PipelineProfile:
    """The stage profile a step's records imply, identical for any order of the records.

    A stage takes its slowest rank's compute and largest activations (its tensor- and
    data-parallel peers move in lockstep), a boundary the slowest of the links that cross it
    (one per pipeline column). ``memory_budget_bytes`` defaults to no limit.
    """
    by_rank = {r.rank: r for r in records}
    if len(by_rank) != len(records):
        raise ValueError("records: one record per rank")
    members = [[r for r in records if r.stage == s] for s in range(num_stages)]
    if any(not m for m in members):
        raise ValueError(f"records: every stage 0..{num_stages - 1} needs a record")
    links = [0.0] * (num_stages - 1)
    for r in records:
        if r.stage < num_stages - 1:
            if r.next_rank not in by_rank:
                raise ValueError(f"records: rank {r.rank}'s next-stage peer has no record")
            links[r.stage] = max(links[r.stage], boundary_seconds(r, by_rank[r.next_rank]))
    budgets = memory_budget_bytes or [math.inf] * num_stages
    return PipelineProfile(
        forward_s=tuple(max(r.forward_s for r in m) for m in members),
        backward_s=tuple(max(r.backward_s for r in m) for m in members),
        transfer_s=tuple(links),
        activation_bytes=tuple(max(r.activation_bytes for r in m) for m in members),
        memory_budget_bytes=tuple(budgets),
    )


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
    result = simulate(
        profile.forward_s,
        profile.backward_s,
        [Trace.constant(c) for c in profile.transfer_s],
        num_microbatches,
        k,
    )
    return Prediction(result.step_time, max(r.step_s for r in recs), profile)
