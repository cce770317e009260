"""Competing traffic for a shaped run: a sink in a rank's namespace, a pusher in the tenant's.

Run as a script (``python tenant.py sink|push ...``), standard library only, so it starts in
milliseconds. Both sides are bounded: the pusher stops after ``--max-bytes`` or
``--max-seconds``, on SIGTERM, or when its launcher dies; the sink stops after
``--max-seconds`` or when its launcher dies. Only addresses of a shaped run (10.213.0.x, which
exist only inside the run's namespaces) are accepted as targets.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
import threading
import time

_CHUNK = 64 * 1024
_RUN_SUBNET = ipaddress.ip_network("10.213.0.0/24")


def _launcher_gone(parent: int) -> bool:
    return os.getppid() != parent


def _drain(conn: socket.socket, deadline: float) -> None:
    conn.settimeout(0.5)
    with conn:
        while time.monotonic() < deadline:
            try:
                if not conn.recv(_CHUNK):
                    return
            except TimeoutError:
                continue
            except OSError:
                return


def sink(bind: str, port: int, max_seconds: float) -> int:
    """Accept connections on ``bind:port`` and discard what arrives, until the deadline."""
    parent, deadline = os.getppid(), time.monotonic() + max_seconds
    server = socket.create_server((bind, port), backlog=64, reuse_port=False)
    server.settimeout(0.2)
    with server:
        while time.monotonic() < deadline and not _launcher_gone(parent):
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_drain, args=(conn, deadline), daemon=True).start()
    return 0


class _Budget:
    """Bytes the pusher may still send, shared by its connections."""

    def __init__(self, nbytes: int) -> None:
        self.left, self._lock = nbytes, threading.Lock()

    def take(self, nbytes: int) -> int:
        with self._lock:
            granted = min(nbytes, self.left)
            self.left -= granted
            return granted


_SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux, bytes/s


def _push(
    address: str, bps: float, port: int, budget: _Budget, stop: threading.Event, deadline: float
) -> None:
    payload = bytes(_CHUNK)
    try:
        with socket.create_connection((address, port), timeout=5) as conn:
            # TCP paces itself to this rate (no fq qdisc needed since Linux 4.13): the tenant
            # takes its share of the shaped link without also filling its queue.
            conn.setsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, max(1, int(bps / 8)))
            conn.settimeout(1.0)
            while not stop.is_set() and time.monotonic() < deadline:
                granted = budget.take(_CHUNK)
                if granted == 0:
                    return
                try:
                    conn.sendall(payload[:granted])
                except TimeoutError:
                    continue
    except OSError:
        return  # the sink went away with the run


def push(targets: dict[str, float], port: int, max_bytes: int, max_seconds: float) -> int:
    """Push bulk TCP to ``{address: bits/s}`` (one paced connection each) until a bound is hit
    or SIGTERM arrives."""
    for address in targets:
        if ipaddress.ip_address(address) not in _RUN_SUBNET:
            raise SystemExit(f"tenant: {address} is not an address of a shaped run")
    parent, stop = os.getppid(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    deadline, budget = time.monotonic() + max_seconds, _Budget(max_bytes)
    threads = [
        threading.Thread(
            target=_push, args=(address, bps, port, budget, stop, deadline), daemon=True
        )
        for address, bps in targets.items()
    ]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads) and not stop.is_set():
        if _launcher_gone(parent):
            stop.set()
        time.sleep(0.05)
    stop.set()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="role", required=True)
    s = sub.add_parser("sink")
    s.add_argument("--bind", required=True)
    p = sub.add_parser("push")
    p.add_argument("--to", action="append", required=True, help="ADDRESS:BITS_PER_SECOND")
    p.add_argument("--max-bytes", type=int, required=True)
    for each in (s, p):
        each.add_argument("--port", type=int, required=True)
        each.add_argument("--max-seconds", type=float, required=True)
    args = parser.parse_args(argv)
    if args.role == "sink":
        return sink(args.bind, args.port, args.max_seconds)
    targets = {t.rsplit(":", 1)[0]: float(t.rsplit(":", 1)[1]) for t in args.to}
    return push(targets, args.port, args.max_bytes, args.max_seconds)


if __name__ == "__main__":
    sys.exit(main())
