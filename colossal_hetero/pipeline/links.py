"""Link time from the per-message timestamps of a measured pipeline step. Pure (no torch).

A sender notes when each message went onto the link (its ``isend``s issued), a receiver when it
posted each message's receive and when the message arrived. The receiver knows the arrival only
when it was blocked in ``wait()`` (the data was not there yet: it returned on arrival); an
arrival it did not wait for is recorded as ``-1``. A message can move only once it is sent, its
receive is posted and the message before it on the link has landed, so one blocked receive gives
one sample of the link time: ``arrived_j - max(sent_j, posted_j, arrived_{j-1})`` (the last term
only when message ``j - 1``'s receive blocked too, else its arrival is unknown). The direction's
link time is the median sample (robust to the odd wait that blocked for other reasons), 0 when
no receive blocked (then the transfers were hidden: the link did not hold anyone up). A
boundary's time is the larger of its two directions (the simulator runs both on one trace). The
times of all ranks must be on one clock: ``time.time()``, which ranks on one host share exactly
and ranks on several hosts share to their clock synchronisation. With shared ports, the times
per message into one rank's download must also fit the time its arrivals took there
(:func:`_port_scale`): a queue ahead of the port (a tenant's) is latency, not link time.
"""

from __future__ import annotations

import statistics
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from colossal_hetero.pipeline.profile import RankRecord

NOT_BLOCKED = -1.0
"""The arrival time recorded for a receive whose ``wait()`` found the data already there."""
_Span = tuple[float, float]
"""``(release, asked)`` of a message its receiver found landed: it landed in between."""


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
    step's header)."""
    on_ask: bool
    """Whether it could move only once its receiver asked for it: a first message whose
    receives were posted after its metadata was read (not early: :func:`first_posted_early`)."""


def first_posted_early(records: Sequence[RankRecord]) -> bool:
    """Whether the step's first messages had their receives posted as the step started (the
    receivers kept the last step's metadata, ``pipeline/p2p.py``): then they moved when sent,
    not once asked for (``RankRecord.first_early``)."""
    return any(r.first_early > 0 for r in records)


def _messages(records: Sequence[RankRecord]) -> list[_Message]:
    """Every message between pipeline neighbours, in the order they could move."""
    early = first_posted_early(records)
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
                on_ask = j == 0 and not early
                msg = _Message(
                    release, src.rank, dst.rank, kind, arrived[j], when, sent[j], j, on_ask
                )
                out.append(msg)
    return sorted(out, key=lambda m: (m.release, m.src, m.dst, m.kind))


def _seconds(
    msg: _Message,
    history: Sequence[tuple[float, float]],
    seen: float,
    crossing: Callable[[float, float], int] | None = None,
) -> tuple[float, str, float]:
    """Link seconds of one message that landed at ``msg.arrived``: the least of the upper
    bounds a first-in first-out link of constant time per message gives. ``history`` holds the
    earlier messages of its direction, ``(release, landing seen or NOT_BLOCKED)`` in order:
    messages ``i .. j`` all moved after ``release_i``, one at a time, and after a landing seen
    on message ``i`` the rest did. ``seen``: the last landing seen on the ports it shares with
    other directions (it moved after that, too). ``crossing(after, before)``: how many messages
    of the other directions the busiest port it crossed carried strictly in between
    (:meth:`_PortLandings.busiest`; None: no shared port); those between a landing seen and
    this one took that port's time too. The ports work side by side, so the busiest of them
    bounds the time (session 10: summing both ports' messages halved it on a middle stage of
    PP=4).
    Also which bound it is: ``"queued"`` (after a landing seen: the link's time per message
    alone), ``"alone"`` (its own release, no message ahead: its time per message plus any
    latency) or ``"burst"`` (an earlier release); and for ``"queued"``, how long before that
    landing the message was released."""
    best = msg.arrived - max(msg.release, seen)
    how, ahead = ("alone", 0.0) if msg.release >= seen else ("queued", seen - msg.release)
    for n, (release, landed) in enumerate(reversed(history), start=2):
        if landed != NOT_BLOCKED:  # crossing is sorted: count landed < t < arrived by bisection
            between = 0 if crossing is None else crossing(landed, msg.arrived)
            bound, kind = (msg.arrived - landed) / (n - 1 + between), "queued"
        else:
            bound, kind = (msg.arrived - release) / n, "burst"
        if bound < best:
            best, how, ahead = bound, kind, landed - msg.release
        if landed != NOT_BLOCKED:
            break
    return max(0.0, best), how, ahead


class _PortLandings:
    """The landings seen so far on each shared port (``("up", rank)`` or ``("down", rank)``),
    all kinds together and per kind, sorted, so that the messages of the other kinds one port
    carried in a span are counted by bisection (a step's link reading is then O(n log n) in
    its messages, not O(n^2): PP=8 with m = 64 read in 28 ms before)."""

    def __init__(self, unseen: Mapping[tuple[str, int], Sequence[tuple[Any, _Span]]]) -> None:
        self.times: dict[tuple[str, int], list[float]] = {}
        self.of_kind: dict[tuple[tuple[str, int], Any], list[float]] = {}
        found = {port: sorted((lo, hi, kind) for kind, (lo, hi) in v) for port, v in unseen.items()}
        self.found = found
        """Per port, the messages the receiver found landed, ``(release, asked, kind)`` sorted."""
        self.found_release = {port: [lo for lo, _, _ in v] for port, v in found.items()}

    def add(self, port: tuple[str, int], landed: float, kind: Any) -> None:
        insort(self.times.setdefault(port, []), landed)
        insort(self.of_kind.setdefault((port, kind), []), landed)

    def latest(self, ports: Sequence[tuple[str, int]]) -> float:
        """The last landing seen on any of ``ports`` (``NOT_BLOCKED`` if none)."""
        return max([NOT_BLOCKED, *(self.times[q][-1] for q in ports if self.times.get(q))])

    def last_other(self, ports: Sequence[tuple[str, int]], kind: Any, before: float) -> float:
        """The last landing of a kind other than ``kind`` on ``ports`` strictly before ``before``
        (``NOT_BLOCKED`` if none). A first message that queued behind those (PP=4, k = 4: a
        stage's first gradient behind the bursts of activations on its sender's upload and its
        receiver's download, 46-57 ms where it takes ~13 alone) is queued behind them by the
        simulator too, so its own time starts there, not at its send."""
        last = NOT_BLOCKED
        for (port, k), times in self.of_kind.items():
            i = bisect_left(times, before) if port in ports and k != kind else 0
            last = max(last, times[i - 1]) if i else last
        return last

    def busiest(
        self, ports: Sequence[tuple[str, int]], kind: Any, after: float, before: float
    ) -> int:
        """The most messages of kinds other than ``kind`` one of ``ports`` carried strictly
        between ``after`` and ``before``: its landings there and its messages found landed
        (``(release, asked)`` both inside)."""
        counts = [0]
        for port in ports:
            every, own = self.times.get(port, []), self.of_kind.get((port, kind), [])
            landed = _count_inside(every, after, before) - _count_inside(own, after, before)
            spans, releases = self.found.get(port, []), self.found_release.get(port, [])
            inside = spans[bisect_right(releases, after) : bisect_left(releases, before)]
            found = sum(1 for _, hi, k in inside if k != kind and hi < before)
            counts.append(landed + found)
        return max(counts)


def _count_inside(times: Sequence[float], after: float, before: float) -> int:
    """How many of the sorted ``times`` lie strictly between ``after`` and ``before`` (negative
    when ``after`` is not below ``before``: differences of such counts stay exact)."""
    return bisect_left(times, before) - bisect_right(times, after)


_Sample = tuple[float, str, float, float]
"""One link sample (:func:`_seconds`): seconds, which bound, how long before the landing ahead
it was released, and its delay from release to landing."""


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
    shared port it crossed (:meth:`_PortLandings.last_other`: the simulator queues it behind
    those too).
    Links that let a lone message through at once and charge it after (token debt,
    :func:`_debt_spacing`) split as :func:`_debt_link`. Keys: ``F``, ``B`` (per message),
    ``LF``, ``LB`` (latency), ``F0``, ``B0`` (first messages), ``D`` (1: token debt), one value
    per boundary. The same for any order of the records."""
    samples, downloads = _step_samples(records, shared_ports)
    return _per_boundary(samples, num_stages, downloads)


def column_link_seconds(
    records: Sequence[RankRecord], shared_ports: bool = True
) -> dict[tuple[str, int, int], tuple[float, float]]:
    """Per pipeline column (``(op, boundary, sending-side rank)``: ``"F"`` or ``"B"``, the
    boundary, and the global rank on the boundary's upstream stage): the seconds one message
    held that column's link and the latency after it, as :func:`link_seconds` reads them
    before it keeps each boundary's slowest column. A column none of whose receives waited is
    absent (its transfers were hidden)."""
    samples, downloads = _step_samples(records, shared_ports)
    return {k: v for k, v in _column_splits(samples, downloads).items() if k[0] in ("F", "B")}


def landed_within(records: Sequence[RankRecord]) -> dict[tuple[str, int, int], float]:
    """Per pipeline column (as :func:`column_link_seconds`), the least ``asked - released`` of
    its messages that had landed when their receiver asked for them: each took at most that
    long on its link. Columns with no such message are absent."""
    out: dict[tuple[str, int, int], float] = {}
    for msg in _messages(records):
        if msg.arrived == NOT_BLOCKED and msg.asked != NOT_BLOCKED:
            within = max(0.0, msg.asked - msg.release)
            out[msg.kind] = min(out.get(msg.kind, within), within)
    return out


def _step_samples(
    records: Sequence[RankRecord], shared_ports: bool
) -> tuple[dict[tuple[str, int, int], list[_Sample]], dict[int, _Download]]:
    """Each direction's link samples of one step (see :func:`link_seconds`) and, with
    ``shared_ports``, each receiving rank's download."""
    history: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    samples: dict[tuple[str, int, int], list[_Sample]] = {}
    messages = _messages(records)
    unseen = _unseen_by_port(messages) if shared_ports else {}
    on_ports = _PortLandings(unseen)
    for msg in messages:
        ports = [("up", msg.src), ("down", msg.dst)] if shared_ports else []
        earlier = history.setdefault(msg.kind, [])
        op, boundary, column = msg.kind
        landed = NOT_BLOCKED
        if msg.on_ask:  # it landed before it was asked for if its wait did not block
            landed = msg.arrived
            begin = max(msg.sent, msg.asked, on_ports.last_other(ports, msg.kind, msg.arrived))
            first = 0.0 if landed == NOT_BLOCKED else max(0.0, landed - begin)
            samples.setdefault((f"{op}0", boundary, column), []).append(
                (first, "first", 0.0, first)
            )
        else:
            latest = on_ports.latest(ports)
            crossing = partial(on_ports.busiest, ports, msg.kind) if ports else None
            seconds, how, ahead = _seconds(msg, earlier, latest, crossing)
            if _waited(msg, seconds):
                delay = max(0.0, msg.arrived - msg.release)
                samples.setdefault(msg.kind, []).append((seconds, how, ahead, delay))
                landed = msg.arrived
        earlier.append((msg.release, landed))
        if landed != NOT_BLOCKED:
            for port in ports:
                on_ports.add(port, landed, msg.kind)
    downloads = _downloads(messages, unseen) if shared_ports else {}
    return samples, downloads


_Download = tuple[list[tuple[float, tuple[str, int, int]]], list[tuple[Any, tuple[float, float]]]]
"""One rank's download: the known arrivals there, ``(time, kind)`` in time order (first
messages aside), and the messages found landed (``(kind, (release, asked))``)."""


def _downloads(
    messages: Sequence[_Message],
    unseen: Mapping[tuple[str, int], Sequence[tuple[Any, tuple[float, float]]]],
) -> dict[int, _Download]:
    """Each receiving rank's :data:`_Download`."""
    landed: dict[int, list[tuple[float, tuple[str, int, int]]]] = {}
    for msg in messages:
        landed.setdefault(msg.dst, [])
        if msg.index > 0 and msg.arrived != NOT_BLOCKED:
            landed[msg.dst].append((msg.arrived, msg.kind))
    return {dst: (sorted(t), list(unseen.get(("down", dst), []))) for dst, t in landed.items()}


MIN_PORT_LANDINGS = 5
"""Known arrivals a download needs before :func:`_port_scale` bounds its times per message."""


def _port_scale(download: _Download, seconds: Mapping[tuple[str, int, int], float]) -> float:
    """At most 1: how far the times per message (``seconds`` per kind) of the messages into one
    download must shrink to fit the time they took there. A first-in first-out port holds each
    message for its time, so the messages landing over a run of consecutive arrivals took at
    most that run's time; runs over half the arrivals leave out the step's fill and drain,
    when the port idles. A queue ahead of the port (a tenant's, which messages wait out
    together) delays them without spacing them apart: read per message, it would overstate
    their times (PP=4 under the tenant: 20-27 ms per message on rank 2's download, which
    carried both kinds at ~16 ms each)."""
    landed, spans = download
    if len(landed) < MIN_PORT_LANDINGS:
        return 1.0
    span, scale = (len(landed) - 1) // 2, 1.0
    for i in range(len(landed) - span):
        lo, hi = landed[i][0], landed[i + span][0]
        kinds = [kind for _, kind in landed[i + 1 : i + span + 1]]
        kinds += [kind for kind, (a, b) in spans if lo < a and b < hi]
        need = sum(seconds.get(kind, 0.0) for kind in kinds)
        if need > (hi - lo) * (1 + 1e-9):  # beyond rounding: back-to-back is exactly full
            scale = min(scale, (hi - lo) / need)
    return scale


def _per_boundary(
    samples: Mapping[tuple[str, int, int], Sequence[_Sample]],
    num_stages: int,
    downloads: Mapping[int, _Download] | None = None,
) -> dict[str, tuple[float, ...]]:
    """:func:`link_seconds`' result from its samples per (kind, boundary, column); ``D`` is 1 on
    every boundary when the step's links run in token debt (:func:`_debt_spacing`), else 0.
    ``downloads`` (shared ports): each receiving rank's, whose times per message are fitted to
    the time they took there (:func:`_port_scale`, :func:`_scaled`)."""
    split = _column_splits(samples, downloads)
    pooled = _debt_spacing(samples)

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


def _column_splits(
    samples: Mapping[tuple[str, int, int], Sequence[_Sample]],
    downloads: Mapping[int, _Download] | None = None,
) -> dict[tuple[str, int, int], tuple[float, float]]:
    """(seconds per message, latency) per (kind, boundary, column), the port fit applied."""
    pooled = _debt_spacing(samples)
    split = {
        key: _debt_link(v, pooled)
        if pooled is not None and key[0] in ("F", "B")
        else _link_and_latency(v)
        for key, v in samples.items()
    }
    per_message = {key: v[0] for key, v in split.items() if key[0] in ("F", "B")}
    for download in (downloads or {}).values():
        scale = _port_scale(download, per_message)
        for key in {kind for _, kind in download[0]} & per_message.keys():
            split[key] = _scaled(split[key], scale, debt=pooled is not None)
    return split


def _scaled(split: tuple[float, float], scale: float, debt: bool) -> tuple[float, float]:
    """A direction's (seconds per message, latency) with the time per message times ``scale``
    (:func:`_port_scale`). A lone message keeps its delay: without token debt that is both
    together, so what the time per message loses moves to the latency; under debt it is the
    latency alone (the simulator lands such a message when it starts)."""
    per_message, latency = split
    if scale >= 1.0:
        return split
    return per_message * scale, latency if debt else latency + per_message * (1.0 - scale)


DEBT_SHARE = 0.5
"""Lone messages landing in less than this share of the queued ones' spacing show a shaper
that lets a message through on credit and charges it after (:func:`_debt_spacing`)."""
MIN_QUEUED = 3
"""Queued samples a direction needs for its own time per message under token debt (fewer:
the step's pooled spacing)."""


def _debt_spacing(
    samples: Mapping[tuple[str, int, int], Sequence[_Sample]],
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
        alone = [x for x, how, *_ in values if how == "alone"]
        queued = [x for x, how, *_ in values if how == "queued"]
        if alone and queued and statistics.median(alone) < DEBT_SHARE * statistics.median(queued):
            pooled += queued
    return statistics.median(pooled) if pooled else None


def _debt_link(values: Sequence[_Sample], pooled: float) -> tuple[float, float]:
    """(seconds per message, latency) of one direction under token debt: its median queued
    sample (the step's ``pooled`` one with fewer than :data:`MIN_QUEUED`), and its median lone
    sample as the latency (a lone message lands that long after it starts: the simulator adds
    it to every landing, queued ones included, which then land one transfer time apart)."""
    queued = [x for x, how, *_ in values if how == "queued"]
    alone = [x for x, how, *_ in values if how == "alone"]
    per_message = statistics.median(queued) if len(queued) >= MIN_QUEUED else pooled
    return per_message, statistics.median(alone) if alone else 0.0


def _link_and_latency(values: Sequence[_Sample]) -> tuple[float, float]:
    """(seconds per message, latency) of one direction of one pipeline column from its
    samples ``(seconds, kind, ahead)`` (:func:`_seconds`). A message that queued behind a
    landing on its link or port shows the link's time per message alone (queued messages land
    that far apart); one that moved at once on a free link shows that time plus the latency
    (say a queue behind other traffic, which messages on their way together wait out at once).
    With both kinds: their medians' split. A message released less than the latency before the
    landing it follows did not wait on the link for it (that one had left the link), so with a
    latency found, only those released earlier count as queued, and the split is redone once.
    Otherwise (or when the lone ones are no slower) the median of all samples, no latency."""
    alone = [v for v, how, *_ in values if how == "alone"]
    queued = [(v, ahead) for v, how, ahead, _ in values if how == "queued"]
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
    return statistics.median(v for v, *_ in values), 0.0
