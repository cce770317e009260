"""Step-scheduled preemption of a shaped run: rate changes by ``tc`` and tenant bursts.

Ranks report the step they start with ``report_step`` (one small file per rank in the run
folder, replaced atomically; a rank that reports nothing is simply not waited for). A thread
of the launcher polls those files; when the job's step (the furthest any rank has reached)
changes, it applies the preemptions active at that step: ``tc class change`` on the links of
the ranks whose factor changed, and a restarted tenant pusher when the tenant's targets did.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from colossal_hetero.config.schema import PreemptionSpec
from colossal_hetero.emulation.shaped.tc import rank_change_commands
from colossal_hetero.emulation.shaped.topology import (
    Direction,
    Topology,
    rate_factors,
    tenant_shares,
)

STEP_DIR_ENV = "COLOSSAL_HETERO_STEP_DIR"
"""Set by the shaped launcher on every rank: the folder ``report_step`` writes to."""

_POLL_S = 0.01


def report_step(run_dir: str | os.PathLike[str], rank: int, step: int) -> None:
    """Record that ``rank`` starts ``step`` (a write and a rename: tens of microseconds)."""
    path = Path(run_dir) / f"step_{rank}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(step))
    os.replace(tmp, path)


class StepReporter:
    """A step-seam controller (``on_step_begin``) that calls ``report_step`` for this rank.

    Outside a shaped run (no ``COLOSSAL_HETERO_STEP_DIR``) it does nothing. Reporting a step
    twice (the trainer also reports) is harmless: the file just holds the same number.
    """

    def __init__(self, rank: int, run_dir: str | None = None) -> None:
        self.rank = rank
        self.run_dir = run_dir if run_dir is not None else os.environ.get(STEP_DIR_ENV)

    def on_step_begin(self, step: int) -> None:
        if self.run_dir:
            report_step(self.run_dir, self.rank, step)


def job_step(run_dir: str | os.PathLike[str], world: int) -> int | None:
    """The furthest step any rank has reported, or None before the first report."""
    steps = []
    for rank in range(world):
        try:
            steps.append(int((Path(run_dir) / f"step_{rank}").read_text()))
        except (FileNotFoundError, ValueError):
            continue
    return max(steps) if steps else None


@dataclass(frozen=True, slots=True)
class Applied:
    """One change the controller made: at job ``step``, these rate factors and tenant shares."""

    step: int
    factors: tuple[float, ...]
    shares: dict[int, float]
    seconds: float
    """When it was applied, on the launcher's monotonic clock."""


class Controller:
    """Applies ``preemptions`` to a shaped run as its ranks report their steps.

    ``start_tenant(shares)`` starts a pusher taking ``{rank: fraction of its link}`` and returns it
    (the launcher knows the namespaces and caps); the controller stops the previous one first.
    """

    def __init__(
        self,
        topology: Topology,
        directions: list[tuple[Direction, Direction]],
        preemptions: list[PreemptionSpec],
        run_dir: str,
        start_tenant: Callable[[dict[int, float]], subprocess.Popen[bytes]] | None = None,
        run: Callable[[list[str]], None] | None = None,
    ) -> None:
        from colossal_hetero.emulation.shaped.netns import run_cmd

        self.topology, self.directions, self.preemptions = topology, directions, preemptions
        self.run_dir, self._start_tenant = run_dir, start_tenant
        self._run = run or run_cmd
        self.applied: list[Applied] = []
        self.error: BaseException | None = None
        self._factors = tuple([1.0] * topology.world)
        self._shares: dict[int, float] = {}
        self._tenant: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shaped-controller", daemon=True)

    def start(self) -> None:
        if self.preemptions:
            self._thread.start()

    def stop(self) -> None:
        """Stop polling and the tenant; safe to call more than once."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._stop_tenant()

    def _loop(self) -> None:
        last: int | None = None
        while not self._stop.wait(_POLL_S):
            step = job_step(self.run_dir, self.topology.world)
            if step is None or step == last:
                continue
            last = step
            try:
                self.apply(step)
            except Exception as error:  # reported by the launcher after the run
                self.error = error
                return

    def apply(self, step: int) -> None:
        """Bring links and tenant to what the preemptions say for ``step``."""
        world = self.topology.world
        factors = rate_factors(self.preemptions, step, world)
        shares = tenant_shares(self.preemptions, step, world)
        if factors == self._factors and shares == self._shares:
            return
        for rank, (old, new) in enumerate(zip(self._factors, factors, strict=True)):
            if old != new:
                up, down = self.directions[rank]
                for argv in rank_change_commands(self.topology, rank, up, down, new):
                    self._run(argv)
        if shares != self._shares:
            self._stop_tenant()
            if shares and self._start_tenant is not None:
                self._tenant = self._start_tenant(shares)
        self._factors, self._shares = factors, shares
        self.applied.append(Applied(step, factors, dict(shares), time.monotonic()))

    def _stop_tenant(self) -> None:
        if self._tenant is not None and self._tenant.poll() is None:
            self._tenant.terminate()
            try:
                self._tenant.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._tenant.kill()
                self._tenant.wait()
        self._tenant = None
