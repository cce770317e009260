"""Decision records of the runtime controllers (balancer, pipeline k-tuner, ...).

One record per decision, ``{"step", "controller", "inputs", "decision", "predicted_gain"}``,
and a later record with the measured gain; each controller on each rank writes
``{name}_rank{rank}.jsonl`` beside the per-step metrics.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any


def decision_log_path(folder: str | Path, name: str, rank: int) -> Path:
    """Where controller ``name`` of ``rank`` writes: ``{folder}/{name}_rank{rank}.jsonl``."""
    return Path(folder) / f"{name}_rank{rank}.jsonl"


class DecisionWriter:
    """Decision records of one controller on one rank: kept in ``records`` and, with a
    ``folder``, appended as JSON lines to ``decision_log_path(folder, name, rank)`` (flushed
    per record, so a crashed run keeps its decisions). Non-finite floats are written as null
    (JSON has no infinity), in ``records`` too, so both say the same."""

    def __init__(self, folder: str | Path | None, name: str, rank: int) -> None:
        self.records: list[dict[str, Any]] = []
        self.path = None if folder is None else decision_log_path(folder, name, rank)
        self._file: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        record = _finite(record)
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _finite(value: Any) -> Any:
    """``value`` with non-finite floats as None and dict keys as strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
