"""One rank's report at an agreement, and the agreed view of all reports. Pure.

Each rank packs a fixed-length row of floats (:func:`pack`); the runtime all-gathers the rows
(balance/agree.py) and every rank unpacks the same matrix into the same :class:`Agreed`.

Under data or pipeline parallelism the world holds several tensor-parallel groups (one per
replica and stage). Data-parallel replicas of a stage run the same widths and must keep the
same parameters, so one decision serves them all: for each tensor-parallel position the
slowest copy's measurements are taken (a straggler in any group holds every group back at the
step's data-parallel synchronisation). Pipeline stages hold different layers: each stage
decides from its own rows (``stage``), so its in-layer ops balance its own tensor-parallel
group. Each group's own rows stay in ``Agreed.rows`` for the log.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

HEADER = 8
"""Fields before the compute times: tp_rank, group, step_time, bandwidth, move_s,
weight_bytes, allreduce_bytes, stage."""


@dataclass(frozen=True, slots=True)
class Report:
    """What one rank measured over its last window."""

    tp_rank: int
    group: int
    """Index of its tensor-parallel group (replica and stage), the same on the group's ranks."""
    compute: tuple[float, ...]
    """Recent per-step compute seconds, oldest first."""
    step_time: float
    """Median step seconds over the window."""
    bandwidth: float
    """Median all-reduce bytes per second of waiting in them (0 when unseen)."""
    move_s: float = 0.0
    """Seconds its last re-plan and resize took (0: none since the last agreement)."""
    weight_bytes: float = 0.0
    """Bytes of its tensor-parallel weight shards."""
    allreduce_bytes: float = 0.0
    """Median all-reduce payload bytes per step."""
    stage: int = 0
    """Its pipeline stage (0 without pipeline parallelism)."""


def pack(report: Report, window: int) -> list[float]:
    """The row of ``report``: header then ``window`` compute times (NaN-padded in front)."""
    times = list(report.compute[-window:])
    padded = [math.nan] * (window - len(times)) + times
    return [
        float(report.tp_rank),
        float(report.group),
        report.step_time,
        report.bandwidth,
        report.move_s,
        report.weight_bytes,
        report.allreduce_bytes,
        float(report.stage),
        *padded,
    ]


def unpack(row: Sequence[float]) -> Report:
    """Inverse of :func:`pack` (NaN padding dropped)."""
    times = tuple(t for t in row[HEADER:] if not math.isnan(t))
    step_time, bandwidth, move_s, weights, allreduce = (float(v) for v in row[2 : HEADER - 1])
    return Report(
        int(row[0]),
        int(row[1]),
        times,
        step_time,
        bandwidth,
        move_s,
        weights,
        allreduce,
        stage=int(row[HEADER - 1]),
    )


@dataclass(frozen=True, slots=True)
class Agreed:
    """One pipeline stage's reports, and per tensor-parallel position the slowest copy's."""

    rows: tuple[Report, ...]
    positions: tuple[Report, ...]
    """Per tensor-parallel position, the report with the largest median compute."""

    @staticmethod
    def complete(rows: Sequence[Sequence[float]], tp_size: int, stage: int = 0) -> bool:
        """Whether every tensor-parallel position of ``stage`` has a report with compute times."""
        reports = [r for row in rows if (r := unpack(row)).stage == stage]
        return all(any(r.tp_rank == p and r.compute for r in reports) for p in range(tp_size))

    @classmethod
    def of(cls, rows: Sequence[Sequence[float]], tp_size: int, stage: int = 0) -> Agreed:
        """The view of pipeline stage ``stage`` (every row without pipeline parallelism)."""
        reports = tuple(r for row in rows if (r := unpack(row)).stage == stage)
        positions = []
        for position in range(tp_size):
            mine = [r for r in reports if r.tp_rank == position and r.compute]
            assert mine, f"no report for tensor-parallel position {position}"
            positions.append(max(mine, key=lambda r: (statistics.median(r.compute), r.group)))
        return cls(reports, tuple(positions))

    @property
    def windows(self) -> list[list[float]]:
        """Per position, its compute times."""
        return [list(r.compute) for r in self.positions]

    @property
    def times(self) -> tuple[float, ...]:
        """Per position, the median compute seconds per step."""
        return tuple(statistics.median(r.compute) for r in self.positions)

    @property
    def step_time(self) -> float:
        """The slowest rank's median step seconds (the synchronous step)."""
        return max(r.step_time for r in self.rows)

    @property
    def bandwidth(self) -> float:
        """The all-reduce bandwidth, bytes/s (0 when none seen): the highest rank's. A rank's
        bytes over its wait in the all-reduces understate the link by the time it waited for
        late peers; the last rank to arrive waits for the transfer alone, and reads highest.
        """
        seen = [r.bandwidth for r in self.rows if r.bandwidth > 0]
        return max(seen) if seen else 0.0

    @property
    def move_s(self) -> float:
        """The longest rank's last move, seconds (0: no move reported)."""
        return max(r.move_s for r in self.rows)

    def groups(self) -> dict[int, list[float]]:
        """Per tensor-parallel group, its median compute per position (for the log)."""
        out: dict[int, list[float]] = {}
        for r in sorted(self.rows, key=lambda r: (r.group, r.tp_rank)):
            if r.compute:
                out.setdefault(r.group, []).append(round(statistics.median(r.compute), 6))
        return out
