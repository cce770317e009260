"""Reduce a run's records to the few numbers a report needs."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from colossal_hetero.metrics.records import StepRecord

TIME_FIELDS = ("step_time", "compute_time", "comm_wait")
"""Per-rank timings that ``summarize`` takes medians of."""

BY_KIND_FIELDS = ("bytes_by_kind", "wait_by_kind")
"""Per-rank, per-communication-kind fields that ``summarize`` takes per-kind medians of."""


def summarize(records: Sequence[StepRecord], warmup: int = 1) -> dict[str, Any]:
    """Medians of per-rank timings after warm-up, plus the latest losses.

    The first ``warmup`` distinct steps are left out of timings (compilation, allocator and
    first-collective costs); if that would leave no step, ``warmup`` shrinks to keep the last
    one. A synchronous step lasts as long as its slowest rank, so the overall step time is the
    median over steps of the largest ``step_time`` of the step's ranks. Losses ignore warm-up.
    Per-kind bytes and waits are per-kind medians over the rank's timed steps that recorded
    them (a kind a record lacks counts 0); a rank none of whose records has them (files
    written before they existed) has no such key.

    Returns:
        A JSON-ready dict (``ranks`` has int keys, which ``json`` writes as strings)::

            {"num_steps": int, "warmup": int, "median_step_time": float,
             "ranks": {rank: {"step_time": float, "compute_time": float,
                              "comm_wait": float, "num_steps": int,
                              "bytes_by_kind": {kind: float},    # where recorded
                              "wait_by_kind": {kind: float}}},   # where recorded
             "last_train_loss": float | None, "last_val_loss": float | None,
             "last_val_accuracy": float | None}

    Raises:
        ValueError: ``records`` is empty or ``warmup < 0``.
    """
    if not records:
        raise ValueError("no records to summarize")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    steps = sorted({r.step for r in records})
    warmup = min(warmup, len(steps) - 1)
    timed = [r for r in records if r.step >= steps[warmup]]
    return {
        "num_steps": len(steps),
        "warmup": warmup,
        "median_step_time": _median_slowest_step(timed),
        "ranks": _per_rank_medians(timed),
        "last_train_loss": _last(records, "loss"),
        "last_val_loss": _last(records, "val_loss"),
        "last_val_accuracy": _last(records, "val_accuracy"),
    }


def _per_rank_medians(records: Sequence[StepRecord]) -> dict[int, dict[str, Any]]:
    summary: dict[int, dict[str, Any]] = {}
    for rank in sorted({r.rank for r in records}):
        mine = [r for r in records if r.rank == rank]
        summary[rank] = {
            name: statistics.median(getattr(r, name) for r in mine) for name in TIME_FIELDS
        }
        summary[rank]["num_steps"] = len(mine)
        for name in BY_KIND_FIELDS:
            per_kind = _per_kind_medians([getattr(r, name) for r in mine])
            if per_kind is not None:
                summary[rank][name] = per_kind
    return summary


def _per_kind_medians(values: Sequence[dict[str, Any] | None]) -> dict[str, float] | None:
    """Kind -> median over the dicts given (None entries skipped, missing kinds 0)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    kinds = sorted({kind for v in present for kind in v})
    return {k: float(statistics.median(v.get(k, 0) for v in present)) for k in kinds}


def _median_slowest_step(records: Sequence[StepRecord]) -> float:
    slowest: dict[int, float] = {}
    for r in records:
        slowest[r.step] = max(slowest.get(r.step, 0.0), r.step_time)
    return statistics.median(slowest.values())


def _last(records: Sequence[StepRecord], name: str) -> float | None:
    """The value of ``name`` at the latest step that has one (lowest rank on ties)."""
    candidates = [r for r in records if getattr(r, name) is not None]
    if not candidates:
        return None
    latest = max(candidates, key=lambda r: (r.step, -r.rank))
    return getattr(latest, name)
