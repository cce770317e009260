"""``tc`` command lines that shape one direction of a rank's link. Pure: builds argv lists.

Each shaped interface gets an htb root whose default class ``1:1`` carries the link's default
rate, plus one class per listed peer (``1:<100 + peer>``, hex) chosen by a u32 filter on the
peer's address (destination on an upload, source on a download). Under each class sits a
netem (when the link has latency) or a byte-limited FIFO, a switch port's buffer. Pure TCP
ACKs bypass the shaping (``_ack_commands``). Preemptions change the classes' rates in place
(``tc class change``), so queued packets and open connections survive a rate change.
"""

from __future__ import annotations

import math

from colossal_hetero.emulation.network import LINK_BUFFER_S
from colossal_hetero.emulation.shaped.topology import (
    MTU,
    RANK_IFNAME,
    UNSHAPED_BPS,
    Direction,
    Topology,
)

_QUANTUM = 60000  # bytes per round between sibling classes; htb warns above 200000
QUEUE_S = LINK_BUFFER_S
"""Seconds of traffic a link's queue holds (``queue_bytes``); the network model derives its
queue wait from the same buffer (``emulation.network.LINK_QUEUE_S``)."""
_ACK_NETEM_LIMIT = 10000  # packets; pure ACKs of at most 64 bytes each


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


def netem_limit(bps: float, latency: float) -> int:
    """Packets a delaying netem holds: the bytes in flight on its delay line at the class's rate
    plus the class's queue (``queue_bytes``), in MTU-sized packets. netem counts packets, not
    bytes, so this stands in for the bfifo's byte limit (GSO super-packets larger than an MTU
    make it hold more bytes)."""
    held = bps / 8 * latency + queue_bytes(bps)
    return max(1, math.ceil(held / MTU))


def _leaf_args(
    ns: str, dev: str, classid: str, handle: str, bps: float, latency: float
) -> list[str]:
    """The queue under a data class: netem when the link has latency, else a byte-limited
    FIFO."""
    head = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", classid, "handle", handle]
    if latency > 0:
        return [*head, *_delay(latency), "limit", str(netem_limit(bps, latency))]
    return [*head, "bfifo", "limit", str(queue_bytes(bps))]


def _delay(latency: float) -> list[str]:
    return ["netem", "delay", f"{max(1, round(latency * 1e6))}us"]


def _ack_leaf(ns: str, dev: str, classid: str, handle: str, latency: float) -> list[str]:
    """A netem delaying an ACK class; ACKs are tiny, so netem's packet limit is generous."""
    head = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", classid, "handle", handle]
    return [*head, *_delay(latency), "limit", str(_ACK_NETEM_LIMIT)]


def _data_leaf(ns: str, dev: str, peer: int | None, bps: float, latency: float) -> list[str]:
    handle = f"{0x200 + (0 if peer is None else 1 + peer):x}:"
    return _leaf_args(ns, dev, _classid(peer), handle, bps, latency)


_ACK_CLASS = "1:2"
_ACK_MATCH = (
    *("match", "ip", "protocol", "6", "0xff"),
    *("match", "u8", "0x05", "0x0f", "at", "0"),  # header length 5 words
    *("match", "u16", "0x0000", "0xffc0", "at", "2"),  # total length < 64
    *("match", "u8", "0x10", "0xff", "at", "33"),  # TCP flags: ACK alone
)


def _ack_class(ns: str, dev: str, classid: str) -> list[str]:
    burst = str(burst_bytes(UNSHAPED_BPS))
    return [
        *("tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", classid),
        *("htb", "rate", rate_arg(UNSHAPED_BPS), "burst", burst, "cburst", burst),
        *("quantum", str(_QUANTUM)),
    ]


def _ack_commands(ns: str, dev: str, direction: Direction, match: str) -> list[list[str]]:
    """Pure TCP ACKs (IPv4, 20-byte header, under 64 bytes, only the ACK flag) skip the rate:
    in one FIFO with the reverse direction's data they would wait behind it, and a
    full-duplex transfer (all-to-all) would then run at half its rate. They are ~2% of the
    bytes. They keep the link's latency (a netem under their class), so a connection's round
    trip is both directions' latency; a peer whose latency differs from the default gets its
    own ACK class (``1:<0x300 + peer>``, filtered first)."""
    filt = ["tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip"]
    cmds: list[list[str]] = []
    for peer, (_, latency) in sorted(direction.peers.items()):
        if latency != direction.default_latency:
            classid, address = f"1:{0x300 + peer:x}", f"{Topology.address(peer)}/32"
            cmds.append(_ack_class(ns, dev, classid))
            cmds.append([*filt, "prio", "1", "u32", *_ACK_MATCH])
            cmds[-1] += ["match", "ip", match, address, "flowid", classid]
            if latency > 0:
                cmds.append(_ack_leaf(ns, dev, classid, f"{0x400 + peer:x}:", latency))
    cmds.append(_ack_class(ns, dev, _ACK_CLASS))
    cmds.append([*filt, "prio", "2", "u32", *_ACK_MATCH, "flowid", _ACK_CLASS])
    if direction.default_latency > 0:
        cmds.append(_ack_leaf(ns, dev, _ACK_CLASS, "3ff:", direction.default_latency))
    return cmds


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
    cmds.append(_data_leaf(ns, dev, None, default_bps, direction.default_latency))
    cmds += _ack_commands(ns, dev, direction, match)
    for peer, (bps, latency) in sorted(direction.peers.items()):
        cmds.append(_class_args("add", ns, dev, peer, bps * factor))
        address = f"{Topology.address(peer)}/32"
        cmds.append(
            [
                *("tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip"),
                *("prio", "3", "u32", "match", "ip", match, address, "flowid", _classid(peer)),
            ]
        )
        cmds.append(_data_leaf(ns, dev, peer, bps * factor, latency))
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
