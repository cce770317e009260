"""``tc`` command lines that shape one direction of a rank's link. Pure: builds argv lists.

Each shaped interface gets an htb root whose default class ``1:1`` carries the link's default
rate, plus one class per listed peer (``1:<100 + peer>``, hex) chosen by a u32 filter on the
peer's address (destination on an upload, source on a download). Under each class sits a
netem (when the link has latency) or a byte-limited FIFO, a switch port's buffer. Pure TCP
ACKs bypass the shaping (``_ack_commands``). Preemptions change the classes' rates in place
(``tc class change``), so queued packets and open connections survive a rate change.
"""

from __future__ import annotations

from colossal_hetero.emulation.shaped.topology import (
    MTU,
    RANK_IFNAME,
    UNSHAPED_BPS,
    Direction,
    Topology,
)

_QUANTUM = 60000  # bytes per round between sibling classes; htb warns above 200000
QUEUE_S = 0.02
"""Seconds of traffic a link's queue holds (``queue_bytes``)."""
_NETEM_LIMIT = 10000  # packets a delaying netem may hold (its default, 1000, drops at high rates)


def rate_arg(bps: float) -> str:
    """A tc rate: whole bits per second."""
    return f"{max(1, round(bps))}bit"


def burst_bytes(bps: float) -> int:
    """Bucket size: 100 us of traffic, at least one jumbo frame with its headers.

    A bucket lets that many bytes pass at once after an idle spell, so it must stay below the
    messages being timed: with 32 KiB, a 16 KB all-reduce between two compute phases crossed a
    20 Mbit/s link in 1.2 ms instead of 6.6 ms (one frame: 6.8 ms).
    """
    return max(MTU + 216, int(bps / 8 * 1e-4))


def queue_bytes(bps: float) -> int:
    """A class's FIFO: ``QUEUE_S`` of traffic at its rate, at least two GSO super-packets.

    A switch port's buffer: deep enough to keep a TCP flow at the rate, shallow enough that a
    transfer queued behind another waits tens of milliseconds, not seconds.
    """
    return max(2 * 64 * 1024, int(bps / 8 * QUEUE_S))


def _classid(peer: int | None) -> str:
    return "1:1" if peer is None else f"1:{0x100 + peer:x}"


def _class_args(verb: str, ns: str, dev: str, peer: int | None, bps: float) -> list[str]:
    burst = str(burst_bytes(bps))
    return [
        *("tc", "-n", ns, "class", verb, "dev", dev, "parent", "1:", "classid", _classid(peer)),
        *("htb", "rate", rate_arg(bps), "ceil", rate_arg(bps)),
        *("burst", burst, "cburst", burst, "quantum", str(_QUANTUM)),
    ]


def _leaf_args(ns: str, dev: str, peer: int | None, bps: float, latency: float) -> list[str]:
    """The queue under a class: netem when the link has latency, else a byte-limited FIFO."""
    handle = f"{0x200 + (0 if peer is None else 1 + peer):x}:"
    head = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", _classid(peer), "handle", handle]
    if latency > 0:
        delay = f"{max(1, round(latency * 1e6))}us"
        return [*head, "netem", "delay", delay, "limit", str(_NETEM_LIMIT)]
    return [*head, "bfifo", "limit", str(queue_bytes(bps))]


_ACK_CLASS = "1:2"


def _ack_commands(ns: str, dev: str) -> list[list[str]]:
    """Pure TCP ACKs (IPv4, 20-byte header, under 64 bytes, only the ACK flag) skip the
    shaping: in one FIFO with the reverse direction's data they would wait behind it, and a
    full-duplex transfer (all-to-all) would then run at half its rate. They are ~2% of the
    bytes."""
    burst = str(burst_bytes(UNSHAPED_BPS))
    ack_class = [
        *("tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", _ACK_CLASS),
        *("htb", "rate", rate_arg(UNSHAPED_BPS), "burst", burst, "cburst", burst),
        *("quantum", str(_QUANTUM)),
    ]
    ack_filter = [
        *("tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip"),
        *("prio", "1", "u32", "match", "ip", "protocol", "6", "0xff"),
        *("match", "u8", "0x05", "0x0f", "at", "0"),  # header length 5 words
        *("match", "u16", "0x0000", "0xffc0", "at", "2"),  # total length < 64
        *("match", "u8", "0x10", "0xff", "at", "33"),  # TCP flags: ACK alone
        *("flowid", _ACK_CLASS),
    ]
    return [ack_class, ack_filter]


def shape_commands(
    ns: str, dev: str, direction: Direction, *, match: str, factor: float = 1.0
) -> list[list[str]]:
    """Commands that shape egress of ``dev`` in namespace ``ns`` as ``direction`` says.

    ``match`` is ``"dst"`` (an upload: classes by destination peer) or ``"src"`` (a download);
    every rate is scaled by ``factor``.
    """
    assert match in ("dst", "src"), match
    cmds = [["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb"]]
    cmds[0] += ["default", "1"]
    default_bps = direction.default_bps * factor
    cmds.append(_class_args("add", ns, dev, None, default_bps))
    cmds.append(_leaf_args(ns, dev, None, default_bps, direction.default_latency))
    cmds += _ack_commands(ns, dev)
    for peer, (bps, latency) in sorted(direction.peers.items()):
        cmds.append(_class_args("add", ns, dev, peer, bps * factor))
        address = f"{Topology.address(peer)}/32"
        cmds.append(
            [
                *("tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip"),
                *("prio", "2", "u32", "match", "ip", match, address, "flowid", _classid(peer)),
            ]
        )
        cmds.append(_leaf_args(ns, dev, peer, bps * factor, latency))
    return cmds


def change_commands(ns: str, dev: str, direction: Direction, factor: float) -> list[list[str]]:
    """Commands that set every class of ``direction`` to ``factor`` times its configured rate."""
    cmds = [_class_args("change", ns, dev, None, direction.default_bps * factor)]
    for peer, (bps, _) in sorted(direction.peers.items()):
        cmds.append(_class_args("change", ns, dev, peer, bps * factor))
    return cmds


def rank_shape_commands(
    topology: Topology, rank: int, up: Direction, down: Direction, factor: float = 1.0
) -> list[list[str]]:
    """Both directions of ``rank``'s link: upload on its ``chs0``, download on its switch port."""
    return shape_commands(topology.rank_ns(rank), RANK_IFNAME, up, match="dst", factor=factor) + (
        shape_commands(
            topology.switch_ns, topology.switch_port(rank), down, match="src", factor=factor
        )
    )


def rank_change_commands(
    topology: Topology, rank: int, up: Direction, down: Direction, factor: float
) -> list[list[str]]:
    """Rate changes of both directions of ``rank``'s link to ``factor`` times configured."""
    return change_commands(topology.rank_ns(rank), RANK_IFNAME, up, factor) + change_commands(
        topology.switch_ns, topology.switch_port(rank), down, factor
    )
