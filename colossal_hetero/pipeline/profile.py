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
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import zip_longest
from typing import Any

from colossal_hetero.pipeline.tuner import PipelineProfile, simulate_profile

NOT_BLOCKED = -1.0
"""The arrival time recorded for a receive whose ``wait()`` found the data already there."""

_SCALARS = ("forward_s", "backward_s", "step_s", "activation_bytes", "message_bytes", "overhead_s")
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


@dataclass(frozen=True, slots=True)
class _Message:
    """One message of a step as its two ends saw it (clock times; see the module doc)."""

    release: float
    """When it could move: sent, and its receive posted."""
    src: int
    dst: int
    kind: tuple[str, int, int]
    """(``"F"`` or ``"B"``, boundary, the sending stage's rank of that pipeline column)."""
    arrived: float
    asked: float
    sent: float
    index: int
    """Its place in its direction's messages of the step (0: the first, which carries the
    step's metadata and moves only once its receiver asks for it)."""


def _messages(records: Sequence[RankRecord]) -> list[_Message]:
    """Every message between pipeline neighbours, in the order they could move."""
    by_rank = {r.rank: r for r in records}
    out = []
    for r in records:
        if r.next_rank is None:
            continue
        if r.next_rank not in by_rank:
            raise ValueError(f"records: rank {r.rank}'s next-stage peer has no record")
        nxt = by_rank[r.next_rank]
        for op, src, dst, ends in (
            ("F", r, nxt, (r.sent_next, nxt.posted_prev, nxt.arrived_prev, nxt.asked_prev)),
            ("B", nxt, r, (nxt.sent_prev, r.posted_next, r.arrived_next, r.asked_next)),
        ):
            sent, posted, arrived, asked = ends
            for j in range(min(len(sent), len(posted), len(arrived))):
                when = asked[j] if j < len(asked) else NOT_BLOCKED
                kind = (op, r.stage, r.rank)
                release = max(sent[j], posted[j])
                out.append(
                    _Message(release, src.rank, dst.rank, kind, arrived[j], when, sent[j], j)
                )
    return sorted(out, key=lambda m: (m.release, m.src, m.dst, m.kind))


def _seconds(
    msg: _Message,
    history: Sequence[tuple[float, float]],
    seen: float,
    crossing: Sequence[Sequence[float]] = (),
    unseen: Sequence[Sequence[tuple[float, float]]] = (),
) -> tuple[float, str, float]:
    """Link seconds of one message that landed at ``msg.arrived``: the least of the upper
    bounds a first-in first-out link of constant time per message gives. ``history`` holds the
    earlier messages of its direction, ``(release, landing seen or NOT_BLOCKED)`` in order:
    messages ``i .. j`` all moved after ``release_i``, one at a time, and after a landing seen
    on message ``i`` the rest did. ``seen``: the last landing seen on the ports it shares with
    other directions (it moved after that, too). ``crossing``: per port it crossed, the landings
    of the other directions there, sorted; those between a landing seen and this one took that
    port's time too, and so did those the receiver found landed (``unseen``, per port:
    ``(release, asked)``: it landed between the two) when released after that landing and asked
    for before this one. The ports work side by side, so the busiest of them bounds the time
    (session 10: summing both ports' messages halved it on a middle stage of PP=4).
    Also which bound it is: ``"queued"`` (after a landing seen: the link's time per message
    alone), ``"alone"`` (its own release, no message ahead: its time per message plus any
    latency) or ``"burst"`` (an earlier release); and for ``"queued"``, how long before that
    landing the message was released."""
    best = msg.arrived - max(msg.release, seen)
    how, ahead = ("alone", 0.0) if msg.release >= seen else ("queued", seen - msg.release)
    for n, (release, landed) in enumerate(reversed(history), start=2):
        if landed != NOT_BLOCKED:  # crossing is sorted: count landed < t < arrived by bisection
            between = _busiest_port(crossing, unseen, landed, msg.arrived)
            bound, kind = (msg.arrived - landed) / (n - 1 + between), "queued"
        else:
            bound, kind = (msg.arrived - release) / n, "burst"
        if bound < best:
            best, how, ahead = bound, kind, landed - msg.release
        if landed != NOT_BLOCKED:
            break
    return max(0.0, best), how, ahead


def _busiest_port(
    crossing: Sequence[Sequence[float]],
    unseen: Sequence[Sequence[tuple[float, float]]],
    after: float,
    before: float,
) -> int:
    """The most messages of other directions one port carried strictly between ``after`` and
    ``before``: its landings there (sorted: counted by bisection) and its messages found landed
    (``(release, asked)`` both inside)."""
    counts = [
        bisect_left(landings, before)
        - bisect_right(landings, after)
        + len([lo for lo, hi in spans if after < lo and hi < before])
        for landings, spans in zip_longest(crossing, unseen, fillvalue=())
    ]
    return max([0, *counts])


DESCHEDULED_S = 0.01
"""Longest wait a receiver descheduled by the OS can show (about the kernel scheduler's latency
period: 12 ms on 2 cores by default); a longer wait really waited for data."""


def _waited(msg: _Message, seconds: float) -> bool:
    """Whether the receiver really waited for the message: its wait blocked for at least half
    of the message's link time, or longer than :data:`DESCHEDULED_S`. A short wait at the end
    of a long interval is the receiver descheduled after the data had landed (a loaded host),
    not a slow link."""
    if msg.arrived == NOT_BLOCKED:
        return False
    if msg.asked == NOT_BLOCKED:
        return True
    return msg.arrived - msg.asked >= min(0.5 * seconds, DESCHEDULED_S)


def _unseen_by_port(
    messages: Sequence[_Message],
) -> dict[tuple[str, int], list[tuple[tuple[str, int, int], tuple[float, float]]]]:
    """Messages whose receiver found them landed, on each port they crossed: their kind and
    ``(release, asked)`` (they landed in between)."""
    unseen: dict[tuple[str, int], list[tuple[tuple[str, int, int], tuple[float, float]]]] = {}
    for msg in messages:
        if msg.arrived == NOT_BLOCKED and msg.asked != NOT_BLOCKED:
            for port in (("up", msg.src), ("down", msg.dst)):
                unseen.setdefault(port, []).append((msg.kind, (msg.release, msg.asked)))
    return unseen


def link_seconds(
    records: Sequence[RankRecord], num_stages: int, shared_ports: bool = True
) -> dict[str, tuple[float, ...]]:
    """Seconds one message holds each boundary's link, activations and gradients apart, the
    latency each direction adds after that, and the seconds of each direction's first message.

    Each later message that the receiver really waited for (:func:`_waited`) gives one sample
    (:func:`_seconds`): its direction is a first-in first-out link and, with ``shared_ports``,
    it also queued behind the other direction's messages through the sender's upload or the
    receiver's download (a rank's one network interface; the other direction's landings there,
    seen or bounded, :func:`_unseen_by_port`). A direction splits into link time and latency
    (:func:`_link_and_latency`); each is its slowest pipeline column's, 0 when no receive
    waited (the transfers were hidden). The first message is timed from when it was both sent
    and asked for to its arrival, less its direction's latency (which the simulator adds to
    every landing): its tensors' receives are posted only then, after its metadata
    (``pipeline/p2p.py``), and from the last landing of another direction before it on a
    shared port it crossed (:func:`_ports_free`: the simulator queues it behind those too).
    Links that let a lone message through at once and charge it after (token debt,
    :func:`_debt_spacing`) split as :func:`_debt_link`. Keys: ``F``, ``B`` (per message),
    ``LF``, ``LB`` (latency), ``F0``, ``B0`` (first messages), ``D`` (1: token debt), one value
    per boundary. The same for any order of the records."""
    history: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    seen: dict[tuple[str, int], float] = {}
    port_landings: dict[tuple[str, int], list[tuple[float, tuple[str, int, int]]]] = {}
    samples: dict[tuple[str, int, int], list[tuple[float, str, float]]] = {}
    unseen = _unseen_by_port(messages := _messages(records)) if shared_ports else {}
    for msg in messages if shared_ports else _messages(records):
        ports = [("up", msg.src), ("down", msg.dst)] if shared_ports else []
        earlier = history.setdefault(msg.kind, [])
        op, boundary, column = msg.kind
        landed = NOT_BLOCKED
        if msg.index == 0:  # it landed before it was asked for if its wait did not block
            landed = msg.arrived
            begin = max(msg.sent, msg.asked, _ports_free(port_landings, ports, msg))
            first = 0.0 if landed == NOT_BLOCKED else max(0.0, landed - begin)
            samples.setdefault((f"{op}0", boundary, column), []).append((first, "first", 0.0))
        else:
            latest = max([NOT_BLOCKED, *(seen.get(q, -1) for q in ports)])
            crossing = [
                sorted(t for t, kind in port_landings.get(q, []) if kind != msg.kind) for q in ports
            ]
            found = [[span for kind, span in unseen.get(q, []) if kind != msg.kind] for q in ports]
            seconds, how, ahead = _seconds(msg, earlier, latest, crossing, found)
            if _waited(msg, seconds):
                samples.setdefault(msg.kind, []).append((seconds, how, ahead))
                landed = msg.arrived
        earlier.append((msg.release, landed))
        if landed != NOT_BLOCKED:
            for port in ports:
                seen[port] = max(seen.get(port, landed), landed)
                port_landings.setdefault(port, []).append((landed, msg.kind))
    return _per_boundary(samples, num_stages)


def _per_boundary(
    samples: Mapping[tuple[str, int, int], Sequence[tuple[float, str, float]]], num_stages: int
) -> dict[str, tuple[float, ...]]:
    """:func:`link_seconds`' result from its samples per (kind, boundary, column); ``D`` is 1 on
    every boundary when the step's links run in token debt (:func:`_debt_spacing`), else 0."""
    pooled = _debt_spacing(samples)
    split = {
        key: _debt_link(v, pooled)
        if pooled is not None and key[0] in ("F", "B")
        else _link_and_latency(v)
        for key, v in samples.items()
    }

    def slowest(key: str, part: int) -> tuple[float, ...]:
        return tuple(
            max([v[part] for (o, b, _), v in split.items() if (o, b) == (key, s)], default=0.0)
            for s in range(num_stages - 1)
        )

    out: dict[str, tuple[float, ...]] = {}
    for op in ("F", "B"):
        out[op], out[f"L{op}"] = slowest(op, 0), slowest(op, 1)
        firsts = zip(slowest(f"{op}0", 0), out[f"L{op}"], strict=True)
        out[f"{op}0"] = tuple(max(0.0, x - lat) for x, lat in firsts)
    out["D"] = (float(pooled is not None),) * (num_stages - 1)
    return out


DEBT_SHARE = 0.5
"""Lone messages landing in less than this share of the queued ones' spacing show a shaper
that lets a message through on credit and charges it after (:func:`_debt_spacing`)."""
MIN_QUEUED = 3
"""Queued samples a direction needs for its own time per message under token debt (fewer:
the step's pooled spacing)."""


def _debt_spacing(
    samples: Mapping[tuple[str, int, int], Sequence[tuple[float, str, float]]],
) -> float | None:
    """The step's pooled time per message when its links run in token debt, else None.

    A FIFO link (or one with latency) lands a lone message no sooner than a queued one follows
    the one before it. tc's htb instead sends a packet whenever its bucket is not empty and
    charges it after (a 16 KiB message is one GSO packet): lone messages land at once, queued
    ones one transfer time apart (PP=4 at 20 Mbit/s: lone 0-3 ms, queued 6.6 ms). A direction
    whose median lone sample is below :data:`DEBT_SHARE` of its median queued one shows it;
    with any such direction the step's links are taken to be in debt, and the median of those
    directions' queued samples is the pooled time per message (a k = 1 step has few queued
    samples per direction: 0-13 in all)."""
    pooled: list[float] = []
    for key, values in samples.items():
        if key[0] not in ("F", "B"):
            continue
        alone = [x for x, how, _ in values if how == "alone"]
        queued = [x for x, how, _ in values if how == "queued"]
        if alone and queued and statistics.median(alone) < DEBT_SHARE * statistics.median(queued):
            pooled += queued
    return statistics.median(pooled) if pooled else None


def _debt_link(values: Sequence[tuple[float, str, float]], pooled: float) -> tuple[float, float]:
    """(seconds per message, latency) of one direction under token debt: its median queued
    sample (the step's ``pooled`` one with fewer than :data:`MIN_QUEUED`), and its median lone
    sample as the latency (a lone message lands that long after it starts: the simulator adds
    it to every landing, queued ones included, which then land one transfer time apart)."""
    queued = [x for x, how, _ in values if how == "queued"]
    alone = [x for x, how, _ in values if how == "alone"]
    per_message = statistics.median(queued) if len(queued) >= MIN_QUEUED else pooled
    return per_message, statistics.median(alone) if alone else 0.0


def _ports_free(
    landings: Mapping[tuple[str, int], Sequence[tuple[float, tuple[str, int, int]]]],
    ports: Sequence[tuple[str, int]],
    msg: _Message,
) -> float:
    """The last landing of another direction seen on ``msg``'s shared ports before ``msg``
    landed (``NOT_BLOCKED`` if none). A first message that queued behind those (PP=4, k = 4: a
    stage's first gradient behind the bursts of activations on its sender's upload and its
    receiver's download, 46-57 ms where it takes ~13 alone) is queued behind them by the
    simulator too, so its own time starts there, not at its send."""
    before = [t for q in ports for t, kind in landings.get(q, ()) if kind != msg.kind]
    return max([NOT_BLOCKED] + [t for t in before if t < msg.arrived])


def _link_and_latency(values: Sequence[tuple[float, str, float]]) -> tuple[float, float]:
    """(seconds per message, latency) of one direction of one pipeline column from its
    samples ``(seconds, kind, ahead)`` (:func:`_seconds`). A message that queued behind a
    landing on its link or port shows the link's time per message alone (queued messages land
    that far apart); one that moved at once on a free link shows that time plus the latency
    (say a queue behind other traffic, which messages on their way together wait out at once).
    With both kinds: their medians' split. A message released less than the latency before the
    landing it follows did not wait on the link for it (that one had left the link), so with a
    latency found, only those released earlier count as queued, and the split is redone once.
    Otherwise (or when the lone ones are no slower) the median of all samples, no latency."""
    alone = [v for v, how, _ in values if how == "alone"]
    queued = [(v, ahead) for v, how, ahead in values if how == "queued"]
    latency = 0.0
    for _ in range(2):
        link = [v for v, ahead in queued if ahead > latency]
        if not (alone and link):
            break
        per_message, total = statistics.median(link), statistics.median(alone)
        if total <= per_message:
            break
        latency = total - per_message
    if latency > 0.0:
        return total - latency, latency
    return statistics.median(v for v, _, _ in values), 0.0


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
    largest activations; link times per boundary and direction are
    :func:`link_seconds`. ``memory_budget_bytes`` defaults to no limit. ``shared_ports``
    (default: each rank has one network interface) goes into the profile for the simulator.
    """
    if len({r.rank for r in records}) != len(records):
        raise ValueError("records: one record per rank")
    members = [[r for r in records if r.stage == s] for s in range(num_stages)]
    if any(not m for m in members):
        raise ValueError(f"records: every stage 0..{num_stages - 1} needs a record")
    links = link_seconds(records, num_stages, shared_ports)
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
        first_transfer_s=links["F0"],
        first_transfer_up_s=links["B0"],
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
