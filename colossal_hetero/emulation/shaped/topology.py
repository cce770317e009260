"""What a shaped run builds, as data: names, addresses and every link's rates. Pure.

One network namespace per rank (``<prefix>r<k>``) holds one interface, ``chs0``, whose peer
``p<k>`` sits on a bridge in the switch namespace (``<prefix>sw``); a tenant namespace
(``<prefix>tn``) hangs on the same bridge when a tenant preemption is configured. Addresses are
10.213.0.x inside those namespaces only: nothing is routed anywhere else.

Each rank's link is shaped in both directions: upload on ``chs0`` (rank -> switch), download on
``p<k>`` (switch -> rank). A per-pair link gets its own class on the sender's upload (matched by
destination) and on the receiver's download (matched by source); latency is added once, on the
sender's upload.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

from colossal_hetero.config.schema import NetworkEmulationConfig, PreemptionSpec

PREFIX_ROOT = "chs-"
"""Every namespace a shaped run creates starts with this."""

RANK_IFNAME = "chs0"
"""The interface name of a rank inside its namespace (GLOO_SOCKET_IFNAME)."""

SHAPED_ENV = "COLOSSAL_HETERO_SHAPED"
"""Set on every rank of a shaped run (to its namespace prefix)."""

TENANT_PORT = 5201
"""Where tenant sinks listen, inside the targeted ranks' namespaces."""

MTU = 9000
"""Jumbo frames on the run's veths, as in a cluster's fabric: TCP/IP headers then cost 0.7% of
a link's rate rather than 4.5%."""

UNSHAPED_BPS = 100e9
"""Bits/s of a link the config leaves unlimited (htb needs a rate)."""

_SUBNET = "10.213.0"
_TENANT_HOST = 250
MAX_WORLD = 200


def new_prefix() -> str:
    """A fresh per-run prefix, ``chs-<6 hex>-`` (namespace names stay under 15 characters)."""
    return f"{PREFIX_ROOT}{secrets.token_hex(3)}-"


@dataclass(frozen=True, slots=True)
class Direction:
    """The shaping of one direction of a rank's link: a default class plus per-peer classes.

    ``peers`` maps a peer rank to (bits/s, one-way latency s); traffic to (upload) or from
    (download) that peer uses its class instead of the default.
    """

    default_bps: float
    default_latency: float
    peers: dict[int, tuple[float, float]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Topology:
    """The namespaces, interfaces and addresses of one shaped run of ``world`` ranks."""

    prefix: str
    world: int
    tenant: bool = False

    def __post_init__(self) -> None:
        assert self.prefix.startswith(PREFIX_ROOT) and len(self.prefix) <= 11, self.prefix
        assert 1 <= self.world <= MAX_WORLD, self.world

    def rank_ns(self, rank: int) -> str:
        return f"{self.prefix}r{rank}"

    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}sw"

    @property
    def tenant_ns(self) -> str:
        return f"{self.prefix}tn"

    def namespaces(self) -> list[str]:
        """Every namespace of the run; the switch first (it holds the bridge)."""
        names = [self.switch_ns] + [self.rank_ns(r) for r in range(self.world)]
        return names + [self.tenant_ns] if self.tenant else names

    @staticmethod
    def address(rank: int) -> str:
        return f"{_SUBNET}.{rank + 1}"

    @staticmethod
    def tenant_address() -> str:
        return f"{_SUBNET}.{_TENANT_HOST}"

    @staticmethod
    def switch_port(rank: int) -> str:
        return f"p{rank}"


def _bps(gbps: float | None) -> float:
    return UNSHAPED_BPS if gbps is None else gbps * 1e9


def rank_directions(net: NetworkEmulationConfig, world: int) -> list[tuple[Direction, Direction]]:
    """(upload, download) shaping of every rank's link, before any preemption.

    A listed link ``ranks: [a, b]`` carries ``bandwidth_gbps`` from a to b and
    ``reverse_bandwidth_gbps`` (default: the same) from b to a; its latency is one-way.
    """
    up: list[dict[int, tuple[float, float]]] = [{} for _ in range(world)]
    down: list[dict[int, tuple[float, float]]] = [{} for _ in range(world)]
    for spec in net.links:
        a, b = spec.ranks
        reverse = spec.reverse_bandwidth_gbps
        latency = spec.latency_us / 1e6
        for src, dst, gbps in ((a, b, spec.bandwidth_gbps), (b, a, reverse)):
            bps = _bps(spec.bandwidth_gbps if gbps is None else gbps)
            up[src][dst] = (bps, latency)
            down[dst][src] = (bps, 0.0)  # latency once per direction, on the sender's side
    default_bps, latency = _bps(net.bandwidth_gbps), net.latency_us / 1e6
    return [
        (Direction(default_bps, latency, up[r]), Direction(default_bps, 0.0, down[r]))
        for r in range(world)
    ]


def _active(spec: PreemptionSpec, step: int) -> bool:
    return spec.start_step <= step and (spec.end_step is None or step < spec.end_step)


def rate_factors(preemptions: list[PreemptionSpec], step: int, world: int) -> tuple[float, ...]:
    """Per rank, the product of the active ``kind: rate`` preemptions that touch it at ``step``.

    Every class of a touched rank's link (both directions) is scaled, so a link between a
    preempted and a free rank runs at the preempted rate, as in model mode. Two preemptions on
    the two ends of one link give the smaller factor here, their product in model mode.
    """
    factors = [1.0] * world
    for spec in preemptions:
        if spec.kind == "rate" and _active(spec, step):
            for r in spec.ranks or range(world):
                factors[r] *= spec.factor
    return tuple(factors)


def tenant_shares(preemptions: list[PreemptionSpec], step: int, world: int) -> dict[int, float]:
    """Per targeted rank, the fraction of its link the tenant takes at ``step`` (absent: 0).

    A tenant preemption leaving ``factor`` to the job takes ``1 - factor``; overlapping ones
    leave the product of their factors, as rate preemptions do.
    """
    left: dict[int, float] = {}
    for spec in preemptions:
        if spec.kind == "tenant" and _active(spec, step):
            for r in spec.ranks or range(world):
                left[r] = left.get(r, 1.0) * spec.factor
    return {r: 1.0 - f for r, f in left.items()}


def tenant_targets(preemptions: list[PreemptionSpec], world: int) -> list[int]:
    """Ranks that any tenant preemption ever targets (they get a sink), sorted."""
    ranks = {r for s in preemptions if s.kind == "tenant" for r in (s.ranks or range(world))}
    return sorted(ranks)


def transfer_time(nbytes: float, bps: float) -> float:
    """Seconds ``nbytes`` take at ``bps`` bits/s (the configured rate's prediction)."""
    return 0.0 if math.isinf(bps) else nbytes * 8.0 / bps
