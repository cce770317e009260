"""Launch local ranks on a real shaped network, as torchrun would launch them on loopback.

``run_shaped`` checks the capabilities (before creating anything), builds the run's
namespaces and tc links, starts the preemption controller and any tenant sinks, then starts
each rank with ``ip netns exec NS env MASTER_ADDR=... RANK=... GLOO_SOCKET_IFNAME=chs0 ...``
and torchrun's other variables. Rank 0 writes to this terminal; the others to log files whose
tail is printed when they fail. The first rank to fail stops the others and its exit code is
returned (a signal N reads 128 + N). Everything is removed in a ``finally``: on normal exit, a
crashed rank, ``timeout_s`` (exit 124), SIGINT (130) and SIGTERM (143).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from colossal_hetero.config import ConfigError
from colossal_hetero.config.schema import DeviceKind, NetworkEmulationConfig, RunConfig
from colossal_hetero.emulation.shaped import tenant as tenant_script
from colossal_hetero.emulation.shaped.controller import STEP_DIR_ENV, Controller
from colossal_hetero.emulation.shaped.netns import (
    check_netem_support,
    check_shaped_support,
    create_topology,
    probe_netem,
    remove_namespaces,
)
from colossal_hetero.emulation.shaped.tc import rank_shape_commands
from colossal_hetero.emulation.shaped.topology import (
    RANK_IFNAME,
    SHAPED_ENV,
    TENANT_PORT,
    Direction,
    Topology,
    new_prefix,
    rank_directions,
    tenant_targets,
)
from colossal_hetero.utils.device import kind_needs_accelerator, no_accelerator_env

MASTER_PORT = 29500  # free by construction: the rank namespaces hold nothing else
TENANT_MAX_SECONDS = 3600.0  # the tenant's own bound when the run has no timeout
TENANT_MAX_BYTES = 8 << 30
_GRACE_S = 3.0


class _InterruptedError(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def rank_env(topology: Topology, rank: int, run_dir: str) -> dict[str, str]:
    """The variables torchrun sets for a local rank, plus the shaped run's own."""
    world = str(topology.world)
    return {
        "MASTER_ADDR": topology.address(0),
        "MASTER_PORT": str(MASTER_PORT),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": world,
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": world,
        "GLOO_SOCKET_IFNAME": RANK_IFNAME,
        "OMP_NUM_THREADS": "1",
        **no_accelerator_env(),  # gloo only: NCCL traffic would bypass the shaped links
        STEP_DIR_ENV: run_dir,
        SHAPED_ENV: topology.prefix,
    }


def rank_command(topology: Topology, rank: int, run_dir: str, argv: list[str]) -> list[str]:
    """``ip netns exec NS env K=V ... argv`` for one rank. Pure."""
    env = [f"{k}={v}" for k, v in rank_env(topology, rank, run_dir).items()]
    return ["ip", "netns", "exec", topology.rank_ns(rank), "env", *env, *argv]


def _tenant_cmd(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, "-I", tenant_script.__file__, *args]


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGINT and SIGTERM raise _InterruptedError in the main thread while inside."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        raise _InterruptedError(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process group still running, SIGKILL after a grace period."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + _GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait(procs: list[subprocess.Popen[bytes]], timeout_s: float | None) -> tuple[int, int | None]:
    """(exit code, failed rank): 0 when all succeed, the first failure's code, or 124."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                return _exit_code(code), rank
        if all(code == 0 for code in codes):
            return 0, None
        if deadline is not None and time.monotonic() > deadline:
            return 124, None
        time.sleep(0.05)


def _log_tail(run_dir: str, rank: int, lines: int = 20) -> str:
    path = Path(run_dir) / f"rank{rank}.log"
    if rank == 0 or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def _signals_ignored() -> Iterator[None]:
    """A second Ctrl-C must not cut the cleanup short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _popen(argv: list[str], log: Path | None) -> subprocess.Popen[bytes]:
    """A process in its own session (so a terminal's Ctrl-C reaches only the launcher)."""
    if log is None:
        return subprocess.Popen(argv, start_new_session=True)
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _tenant_bounds(timeout_s: float | None) -> list[str]:
    seconds = TENANT_MAX_SECONDS if timeout_s is None else min(timeout_s, TENANT_MAX_SECONDS)
    return ["--max-seconds", f"{seconds:g}"]


def _start_sinks(
    topology: Topology, targets: list[int], timeout_s: float | None
) -> list[subprocess.Popen[bytes]]:
    sinks = []
    for rank in targets:
        args = ["sink", "--bind", topology.address(rank), "--port", str(TENANT_PORT)]
        cmd = _tenant_cmd(topology.rank_ns(rank), *args, *_tenant_bounds(timeout_s))
        sinks.append(subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL))
    return sinks


def _pusher_starter(
    topology: Topology, directions: list[tuple[Direction, Direction]], timeout_s: float | None
) -> Callable[[dict[int, float]], subprocess.Popen[bytes]]:
    """Starts a tenant pushing, into each rank, its share of the rank's configured download."""

    def start(shares: dict[int, float]) -> subprocess.Popen[bytes]:
        args = ["push", "--port", str(TENANT_PORT), "--max-bytes", str(TENANT_MAX_BYTES)]
        for rank, share in sorted(shares.items()):
            bps = share * directions[rank][1].default_bps
            args += ["--to", f"{topology.address(rank)}:{bps:.0f}"]
        cmd = _tenant_cmd(topology.tenant_ns, *args, *_tenant_bounds(timeout_s))
        return subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)

    return start


def run_shaped(
    net: NetworkEmulationConfig,
    world: int,
    argv: list[str],
    *,
    timeout_s: float | None = None,
    prefix: str | None = None,
    check: Callable[[], None] = check_shaped_support,
    netem_probe: Callable[[], bool] = probe_netem,
) -> int:
    """Run ``argv`` as ``world`` ranks on links shaped as ``net`` says; returns the exit code.

    Raises ConfigError, before anything is built, from ``check`` or when ``net`` asks for
    latency and ``netem_probe`` (a throw-away namespace) finds no netem. ``prefix``
    (``chs-...-``) names the run's namespaces; a fresh one by default."""
    check()
    check_netem_support(net, netem_probe)
    directions = rank_directions(net, world)
    targets = tenant_targets(net.preemptions, world)
    topology = Topology(prefix or new_prefix(), world, tenant=bool(targets))
    run_dir = tempfile.mkdtemp(prefix=topology.prefix)
    procs: list[subprocess.Popen[bytes]] = []
    helpers: list[subprocess.Popen[bytes]] = []
    controller = Controller(
        topology,
        directions,
        net.preemptions,
        run_dir,
        _pusher_starter(topology, directions, timeout_s),
    )
    code, failed = 1, None  # what an unexpected error (raised after cleanup) leaves
    with _signals_raise():
        try:
            shape = [
                c for r in range(world) for c in rank_shape_commands(topology, r, *directions[r])
            ]
            create_topology(topology, shape)
            helpers += _start_sinks(topology, targets, timeout_s)
            controller.start()
            for rank in range(world):
                log = None if rank == 0 else Path(run_dir) / f"rank{rank}.log"
                procs.append(_popen(rank_command(topology, rank, run_dir, argv), log))
            code, failed = _wait(procs, timeout_s)
        except _InterruptedError as interrupt:
            code = 128 + interrupt.signum
            print(f"colossal-hetero: {interrupt}: stopping the shaped run", file=sys.stderr)
        finally:
            with _signals_ignored():
                controller.stop()
                _stop(procs + helpers)
                _report(code, failed, run_dir, timeout_s)
                left = remove_namespaces(topology.namespaces())
                shutil.rmtree(run_dir, ignore_errors=True)
    if left:
        print(f"colossal-hetero: could not remove namespaces {left}", file=sys.stderr)
    if controller.error is not None:
        print(f"colossal-hetero: preemption controller failed: {controller.error}", file=sys.stderr)
        return code or 1
    return code


def _report(code: int, failed: int | None, run_dir: str, timeout_s: float | None) -> None:
    if code == 124 and failed is None:
        print(f"colossal-hetero: shaped run timed out after {timeout_s:g} s", file=sys.stderr)
    elif failed is not None:
        print(f"colossal-hetero: rank {failed} exited with code {code}", file=sys.stderr)
        tail = _log_tail(run_dir, failed)
        if tail:
            print(tail, file=sys.stderr)


def check_shaped_device(device: DeviceKind) -> None:
    """ConfigError unless the run's ranks are gloo (CPU) ranks, the only traffic shaped."""
    if kind_needs_accelerator(device):
        raise ConfigError(
            "emulation.network.mode: shaped shapes gloo traffic between CPU ranks; NCCL runs "
            f"(cluster.device: {device}) are not shaped, use mode: model or cluster.device: cpu"
        )


def launch_training(config: RunConfig, config_path: str | Path, nproc: int) -> int:
    """``colossal-hetero train`` in shaped mode: ``python -m colossal_hetero.train`` per rank.

    ``cluster.device: auto`` runs on CPU here (the ranks see no GPU).
    """
    check_shaped_device(config.cluster.device)
    argv = [sys.executable, "-m", "colossal_hetero.train", "--config", str(config_path)]
    return run_shaped(config.emulation.network, nproc, argv)
