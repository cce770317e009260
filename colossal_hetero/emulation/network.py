"""A modelled network: link bandwidth and latency, and how long each collective takes on it.

Pure: no torch.distributed, no clocks. Units are bytes, bytes/s and seconds throughout.

Legend for the formulas below: ``n`` ranks in the group (global ranks, in group order), ``B``
bytes of the local input tensor, ``T`` bytes of the full (gathered or unscattered) tensor,
``bw_min`` the smallest bandwidth and ``lat`` the largest latency over the links the algorithm
uses at that step. Every time is 0 for ``n == 1`` and whenever the model is disabled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from colossal_hetero.config.schema import NetworkEmulationConfig, PreemptionSpec

_BYTES_PER_GBIT = 1e9 / 8
_SECONDS_PER_US = 1e-6

LINK_BUFFER_S = 0.02
"""Seconds of traffic a link's buffer holds, as a switch port's: shaped mode's drop-tail FIFO
under every tc class is this long at the class's rate (``shaped.tc.queue_bytes``)."""

TCP_BACKOFF = 0.7
"""CUBIC's multiplicative decrease (RFC 8312 beta, Linux's default congestion control): on a
drop a bulk flow's window falls to this fraction."""

LINK_QUEUE_S = LINK_BUFFER_S * (1 + TCP_BACKOFF) / 2
"""Seconds a transfer waits behind a bulk flow on the same link (see ``link_timeline``): a TCP
flow fills a drop-tail buffer far deeper than the path's bandwidth-delay product to the brim,
backs off to ``TCP_BACKOFF`` of it on the drop and refills, so the buffer holds on average
``(1 + TCP_BACKOFF) / 2`` of its length. Measured on shaped links (2 ranks, 200 Mbit/s, 20 ms
buffer): a 64 KB p2p behind a bulk flow in the other direction, whose receiver's ready notice
queued behind it, took 18.4 ms vs 2.4 ms with the receive posted earlier: 16 ms of wait (17
predicted)."""

Pair = tuple[int, int]


def _key(a: int, b: int) -> Pair:
    return (a, b) if a <= b else (b, a)


@dataclass(frozen=True, slots=True)
class NetworkModel:
    """Bandwidth and latency of every link between two ranks, at every step.

    Links are symmetric. A link listed in the config overrides the defaults; an unlisted link
    has the default bandwidth (infinite when ``bandwidth_gbps`` is null but links are listed)
    and the default latency. Preemptions scale bandwidth, never latency.
    """

    world_size: int
    enabled: bool = False
    """False when the config models no link: every time is then 0."""

    default_bandwidth: float = math.inf
    """Bytes/s of an unlisted link."""

    default_latency: float = 0.0
    """Seconds of an unlisted link."""

    links: dict[Pair, tuple[float, float]] = field(default_factory=dict)
    """(low rank, high rank) -> (bytes/s, seconds) for listed links."""

    preemptions: tuple[PreemptionSpec, ...] = ()

    queue: float = LINK_QUEUE_S
    """Seconds a transfer waits behind other traffic per direction at most (``LINK_QUEUE_S``)."""

    rendezvous: bool = True
    """Transfers start once the receiver's ready notice has crossed the reverse direction, as
    gloo's and NCCL's network transports do (``link_timeline.LinkTimeline.rendezvous``)."""

    @classmethod
    def from_config(cls, net: NetworkEmulationConfig, world_size: int) -> NetworkModel:
        """Build the model; raises ValueError for a link that is not between two ranks."""
        links: dict[Pair, tuple[float, float]] = {}
        for i, spec in enumerate(net.links):
            a, b = spec.ranks
            if a == b or not (0 <= a < world_size and 0 <= b < world_size):
                raise ValueError(f"network.links[{i}]: {spec.ranks} is not a link of {world_size}")
            if _key(a, b) in links:
                raise ValueError(f"network.links[{i}]: link {spec.ranks} is listed twice")
            links[_key(a, b)] = (
                spec.bandwidth_gbps * _BYTES_PER_GBIT,
                spec.latency_us * _SECONDS_PER_US,
            )
        bandwidth = net.bandwidth_gbps
        return cls(
            world_size=world_size,
            enabled=net.enabled,
            default_bandwidth=math.inf if bandwidth is None else bandwidth * _BYTES_PER_GBIT,
            default_latency=net.latency_us * _SECONDS_PER_US,
            links=links,
            preemptions=tuple(net.preemptions),
        )

    def link(self, a: int, b: int, step: int) -> tuple[float, float]:
        """(bytes/s, seconds) of the link between global ranks ``a`` and ``b`` at ``step``.

        Overlapping preemptions that touch the link multiply: each takes its share of what the
        others left. A rank's link to itself is free: (inf, 0).
        """
        if a == b:
            return math.inf, 0.0
        default = (self.default_bandwidth, self.default_latency)
        bandwidth, latency = self.links.get(_key(a, b), default)
        for p in self.preemptions:
            active = p.start_step <= step and (p.end_step is None or step < p.end_step)
            if active and (not p.ranks or a in p.ranks or b in p.ranks):
                bandwidth *= p.factor
        return bandwidth, latency

    def link_class(self, rank: int, peers: Iterable[int], step: int) -> int | None:
        """Which class of ``rank``'s link carries its traffic to ``peers``, as shaped mode's tc
        classes do: a listed link has a class of its own, keyed by its peer; every unlisted
        peer shares the default class (None). Traffic to peers of several classes (a ring
        through a listed and an unlisted link) goes on the class of the slowest of those
        links, the one the collective's time is set by (ties: the default class, then the
        lowest peer).

        Each class is a link timeline of its own in the interceptor, so a transfer on a fast
        listed link does not queue behind the default link's traffic, as on shaped links."""
        slowest: dict[int | None, float] = {}
        for peer in peers:
            if peer != rank:
                c = peer if _key(rank, peer) in self.links else None
                slowest[c] = min(slowest.get(c, math.inf), self.link(rank, peer, step)[0])
        if len(slowest) <= 1:
            return next(iter(slowest), None)
        return min(slowest, key=lambda c: (slowest[c], -1 if c is None else c))

    # -- collective times ------------------------------------------------------------------

    def all_reduce_time(self, ranks: Sequence[int], nbytes: int, step: int) -> float:
        """Ring all-reduce: ``2(n-1)/n * B / bw_min + 2(n-1) * lat`` over the ring links."""
        n = len(ranks)
        if not self.enabled or n < 2:
            return 0.0
        bw, lat = self._slowest(_ring(ranks), step)
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat

    def all_gather_time(self, ranks: Sequence[int], total_nbytes: int, step: int) -> float:
        """Ring all-gather: ``(n-1)/n * T / bw_min + (n-1) * lat`` over the ring links."""
        n = len(ranks)
        if not self.enabled or n < 2:
            return 0.0
        bw, lat = self._slowest(_ring(ranks), step)
        return (n - 1) / n * total_nbytes / bw + (n - 1) * lat

    def reduce_scatter_time(self, ranks: Sequence[int], total_nbytes: int, step: int) -> float:
        """Ring reduce-scatter of a ``T``-byte input: the same time as all-gather of ``T``."""
        return self.all_gather_time(ranks, total_nbytes, step)

    def all_to_all_time(self, ranks: Sequence[int], nbytes: int, step: int) -> float:
        """All-to-all: ``(n-1)/n * B / bw_min + (n-1) * lat`` over all pairs of the group."""
        n = len(ranks)
        if not self.enabled or n < 2:
            return 0.0
        bw, lat = self._slowest(_all_pairs(ranks), step)
        return (n - 1) / n * nbytes / bw + (n - 1) * lat

    def broadcast_time(self, ranks: Sequence[int], nbytes: int, step: int) -> float:
        """Pipelined tree broadcast: ``B / bw_min + ceil(log2 n) * lat`` over all pairs."""
        n = len(ranks)
        if not self.enabled or n < 2:
            return 0.0
        bw, lat = self._slowest(_all_pairs(ranks), step)
        return nbytes / bw + math.ceil(math.log2(n)) * lat

    def reduce_time(self, ranks: Sequence[int], nbytes: int, step: int) -> float:
        """Tree reduce: the same time as broadcast of ``B`` bytes."""
        return self.broadcast_time(ranks, nbytes, step)

    def gather_time(self, ranks: Sequence[int], root: int, total_nbytes: int, step: int) -> float:
        """Gather to (or scatter from) ``root``: ``(n-1)/n * T / bw_min + (n-1) * lat``.

        ``root`` is a global rank; only the links between it and the others count, since the
        root's links carry all ``(n-1)/n * T`` bytes that move.
        """
        n = len(ranks)
        if not self.enabled or n < 2:
            return 0.0
        bw, lat = self._slowest(((root, r) for r in ranks if r != root), step)
        return (n - 1) / n * total_nbytes / bw + (n - 1) * lat

    def scatter_time(self, ranks: Sequence[int], root: int, total_nbytes: int, step: int) -> float:
        """Scatter of ``T`` bytes from ``root``: the same time as gather."""
        return self.gather_time(ranks, root, total_nbytes, step)

    def p2p_time(self, src: int, dst: int, nbytes: int, step: int) -> float:
        """Send/recv between global ranks: ``B / bw(src, dst) + lat(src, dst)``."""
        if not self.enabled or src == dst:
            return 0.0
        bw, lat = self.link(src, dst, step)
        return nbytes / bw + lat

    def barrier_time(self, ranks: Sequence[int], step: int) -> float:
        """Barrier: ``(n-1) * lat`` over all pairs (no payload)."""
        n = len(ranks)
        if not self.enabled or n < 2:
            return 0.0
        return (n - 1) * self._slowest(_all_pairs(ranks), step)[1]

    def _slowest(self, pairs: Iterable[Pair], step: int) -> tuple[float, float]:
        """(smallest bandwidth, largest latency) over ``pairs``."""
        bw_min, lat_max = math.inf, 0.0
        for a, b in pairs:
            bw, lat = self.link(a, b, step)
            bw_min, lat_max = min(bw_min, bw), max(lat_max, lat)
        return bw_min, lat_max


def _ring(ranks: Sequence[int]) -> list[Pair]:
    """Links between consecutive ranks of the group, closing the ring."""
    return [(ranks[i], ranks[(i + 1) % len(ranks)]) for i in range(len(ranks))]


def _all_pairs(ranks: Sequence[int]) -> list[Pair]:
    return [(a, b) for i, a in enumerate(ranks) for b in ranks[i + 1 :]]
