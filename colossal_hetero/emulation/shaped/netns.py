"""Network namespaces of a shaped run: the capability check, creation and teardown.

Nothing is created in the host's namespace: each veth pair is made inside the switch namespace
with its rank end moved straight into the rank's namespace, so removing the run's namespaces
removes every interface it made. Teardown first kills what still runs inside them (only
processes of this run can be there), since a namespace with a live process outlives ``ip netns
del``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable

from colossal_hetero.config import ConfigError
from colossal_hetero.config.schema import NetworkEmulationConfig
from colossal_hetero.emulation.shaped.topology import (
    MTU,
    PREFIX_ROOT,
    RANK_IFNAME,
    Topology,
    new_prefix,
)

_TIMEOUT_S = 30  # one ip/tc command; they take milliseconds


def check_shaped_support(
    *, euid: int | None = None, which: Callable[[str], str | None] = shutil.which
) -> None:
    """Raise ConfigError (one line naming emulation.network.mode) unless shaped mode can run.

    It needs root (namespaces and qdiscs) and the ``ip`` and ``tc`` tools. ``euid`` and
    ``which`` stand in for the real ones in tests. Nothing is created.
    """
    euid = os.geteuid() if euid is None else euid
    missing = [tool for tool in ("ip", "tc") if which(tool) is None]
    if euid != 0 or missing:
        why = "root" if euid != 0 else ""
        if missing:
            why = " and ".join([w for w in (why, f"`{'`, `'.join(missing)}` (iproute2)") if w])
        raise ConfigError(
            f"emulation.network.mode: shaped needs {why} to build network namespaces and tc "
            "links; use mode: model (sleeps the modelled time, no privileges)"
        )


def latency_field(net: NetworkEmulationConfig) -> str | None:
    """The config field that asks for latency (needing netem in shaped mode), or None. Pure."""
    if net.latency_us > 0:
        return "emulation.network.latency_us"
    for i, spec in enumerate(net.links):
        if spec.latency_us > 0:
            return f"emulation.network.links[{i}].latency_us"
    return None


def probe_netem(prefix: str | None = None) -> bool:
    """Whether this kernel has the netem qdisc: adds one on the loopback of a throw-away
    namespace (``<prefix>nq``, removed before returning). Needs root."""
    ns = f"{prefix or new_prefix()}nq"
    try:
        run_cmd(["ip", "netns", "add", ns])
        done = _capture(
            ["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
        )
        return done.returncode == 0
    finally:
        remove_namespaces([ns])


def check_netem_support(
    net: NetworkEmulationConfig, probe: Callable[[], bool] = probe_netem
) -> None:
    """ConfigError (one line naming the latency field, suggesting mode: model) when ``net``
    asks for latency and ``probe`` finds no netem; probes only when latency is asked for."""
    field = latency_field(net)
    if field is not None and not probe():
        raise ConfigError(
            f"{field}: shaped mode adds latency with the netem qdisc (sch_netem), which this "
            "kernel lacks; set it to 0 or use emulation.network.mode: model (which models "
            "latency)"
        )


def run_cmd(argv: list[str]) -> None:
    """Run one ip/tc command; RuntimeError with its stderr when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


def setup_commands(topology: Topology) -> list[list[str]]:
    """ip commands that build the run's namespaces, bridge, veth pairs and addresses. Pure."""
    sw = topology.switch_ns
    cmds = [["ip", "netns", "add", ns] for ns in topology.namespaces()]
    cmds += [
        ["ip", "-n", sw, "link", "set", "lo", "up"],
        ["ip", "-n", sw, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", sw, "link", "set", "br0", "up"],
    ]
    hosts = [
        (topology.rank_ns(r), topology.switch_port(r), topology.address(r))
        for r in range(topology.world)
    ]
    if topology.tenant:
        hosts.append((topology.tenant_ns, "ptn", topology.tenant_address()))
    for ns, port, address in hosts:
        cmds += [
            [
                *("ip", "-n", sw, "link", "add", port, "mtu", str(MTU), "type", "veth"),
                *("peer", "name", RANK_IFNAME, "mtu", str(MTU)),
            ],
            ["ip", "-n", sw, "link", "set", RANK_IFNAME, "netns", ns],
            ["ip", "-n", sw, "link", "set", port, "master", "br0"],
            ["ip", "-n", sw, "link", "set", port, "up"],
            ["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", RANK_IFNAME],
            ["ip", "-n", ns, "link", "set", RANK_IFNAME, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
        ]
    return cmds


def _capture(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S)


def list_namespaces(prefix: str = PREFIX_ROOT) -> list[str]:
    """Names of the namespaces that start with ``prefix``."""
    out = _capture(["ip", "netns", "list"])
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(prefix))


def _pids(ns: str) -> list[int]:
    out = _capture(["ip", "netns", "pids", ns])
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def _kill_inside(namespaces: list[str]) -> None:
    """SIGKILL every process still running in ``namespaces`` and wait until they are gone."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        pids = [pid for ns in namespaces for pid in _pids(ns)]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def remove_namespaces(namespaces: list[str]) -> list[str]:
    """Kill what runs inside ``namespaces`` and delete them; returns those that remain."""
    present = [ns for ns in namespaces if ns in set(list_namespaces(""))]
    _kill_inside(present)
    for ns in reversed(present):  # ranks (and their veth ends) before the switch
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_TIMEOUT_S)
    return [ns for ns in namespaces if ns in set(list_namespaces(""))]


def cleanup_leftovers(prefix: str) -> list[str]:
    """Remove every namespace whose name starts with ``prefix`` (a run's, or ``chs-`` for all
    shaped runs); returns the names it removed."""
    assert prefix.startswith(PREFIX_ROOT), prefix  # never sweep namespaces that are not ours
    names = list_namespaces(prefix)
    remove_namespaces(names)
    return names


def create_topology(topology: Topology, shape_cmds: list[list[str]]) -> None:
    """Build the namespaces and links, then shape them; on any failure remove what was made.

    The launcher checks netem first (``check_netem_support``); a netem that still fails here
    raises the same one-line ConfigError.
    """
    try:
        for argv in setup_commands(topology) + shape_cmds:
            run_cmd(argv)
    except BaseException as error:
        remove_namespaces(topology.namespaces())
        if isinstance(error, RuntimeError) and " netem " in str(error):
            raise ConfigError(
                "emulation.network.latency_us: shaped mode adds latency (also a link's) with the "
                "netem qdisc (sch_netem), which failed here; set latency_us: 0 or use "
                "mode: model"
            ) from None
        raise
