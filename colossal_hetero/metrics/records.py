"""The metrics file format: JSON Lines, one ``StepRecord`` per training step per rank.

Each rank appends to its own file, ``metrics_rank{r}.jsonl`` in the run folder, so no rank
waits on another to log. Validation results are not separate records: ``val_loss`` and
``val_accuracy`` ride on the record of the step after which validation ran (the trainer
validates before writing that step's record). Times are seconds.

A line holds every required field (``loss`` as ``null`` where unknown) and only the optional
fields that are set, e.g.::

    {"step":3,"rank":0,"step_time":0.21,"compute_time":0.12,"comm_wait":0.08,"loss":5.1,"lr":0.001}

The per-kind communication fields are objects keyed by kind, e.g.
``"wait_by_kind":{"all_reduce":0.05,"all_to_all":0.0,"p2p":0.03,"other":0.0}``; files written
before they existed parse unchanged (the fields are then None).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

METRICS_FILE_PATTERN = re.compile(r"metrics_rank(\d+)\.jsonl")
"""Names of per-rank metrics files; the group is the rank."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class StepRecord:
    """What one rank measured in one training step."""

    step: int
    """Training step, 0-based (the optimizer step this record ends)."""

    rank: int
    """Global rank that measured it."""

    step_time: float
    """Wall time of the whole training step on this rank, validation excluded."""

    compute_time: float
    """Part of ``step_time`` spent computing (forward, backward, optimizer)."""

    comm_wait: float
    """Part of ``step_time`` spent blocked on communication with other ranks."""

    loss: float | None
    """Training loss of the step, None on ranks that do not see it (e.g. early pipeline
    stages)."""

    stretch_time: float | None = None
    """Time added by compute-slowdown emulation (included in ``compute_time``)."""

    network_delay: float | None = None
    """Time added by network emulation (included in ``comm_wait``)."""

    bytes_by_kind: dict[str, int] | None = None
    """Communication kind (``all_reduce``, ``all_to_all``, ``p2p``, ``other``) -> payload bytes
    this rank handed to that kind's calls to send in the step (``StepTiming.bytes_by_kind``)."""

    wait_by_kind: dict[str, float] | None = None
    """Kind -> part of ``comm_wait`` spent blocked in that kind's calls and waits."""

    lr: float | None = None
    """Learning rate used by the step."""

    val_loss: float | None = None
    """Validation loss measured after this step, if validation ran."""

    val_accuracy: float | None = None
    """Validation accuracy in [0, 1] measured after this step (classifiers only)."""

    tokens_per_second: float | None = None
    """Training tokens per second of the step (text models), whole job."""

    samples_per_second: float | None = None
    """Training samples per second of the step, whole job."""

    def __post_init__(self) -> None:
        """Reject negative steps, ranks and times."""
        if self.step < 0 or self.rank < 0:
            raise ValueError(f"step and rank must be >= 0, got {self.step} and {self.rank}")
        for name in ("step_time", "compute_time", "comm_wait"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def to_json(self) -> str:
        """One JSON line (no newline): required fields always, optional ones when set."""
        data = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name in _REQUIRED or getattr(self, f.name) is not None
        }
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> StepRecord:
        """Parse a line written by ``to_json``; ``from_json(r.to_json()) == r``.

        Raises:
            ValueError: not a JSON object, a required field is missing, a field is unknown,
                or a value has the wrong type.
        """
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError(f"a metrics line must be a JSON object, got {line!r}")
        unknown = set(data) - set(_FIELD_NAMES)
        missing = _REQUIRED - set(data)
        if unknown or missing:
            raise ValueError(
                f"bad metrics record: unknown {sorted(unknown)}, missing {sorted(missing)}"
            )
        return cls(**{name: _coerce(name, value) for name, value in data.items()})


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(StepRecord))
_REQUIRED = frozenset(("step", "rank", "step_time", "compute_time", "comm_wait", "loss"))


def _coerce(name: str, value: Any) -> Any:
    """``value`` checked for field ``name``; numbers become float except step and rank (and
    the values of ``bytes_by_kind``, which stay integers)."""
    if name in _BY_KIND and value is not None:
        return _coerce_by_kind(name, value)
    if name in ("step", "rank"):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return value
    if value is None and name not in ("step_time", "compute_time", "comm_wait"):
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


_BY_KIND = ("bytes_by_kind", "wait_by_kind")


def _coerce_by_kind(name: str, value: Any) -> dict[str, Any]:
    """A per-kind mapping checked: string keys; integer bytes, or numeric seconds as floats."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{name} must map kinds to numbers, got {value!r}")
    number = int if name == "bytes_by_kind" else (int, float)
    for kind, amount in value.items():
        if not isinstance(amount, number) or isinstance(amount, bool) or amount < 0:
            raise ValueError(f"{name}[{kind!r}] must be a number >= 0, got {amount!r}")
    return {k: v if name == "bytes_by_kind" else float(v) for k, v in value.items()}


class MetricsWriter:
    """Appends ``StepRecord`` lines to one file, flushing after each so a crash loses none.

    Use as a context manager or call ``close()``. Opening creates missing parent folders and
    appends to an existing file (a resumed run continues its rank's file).
    """

    def __init__(self, path: str | Path) -> None:
        """Open ``path`` for appending."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = self.path.open("a", encoding="utf-8")

    def write(self, record: StepRecord) -> None:
        """Append ``record`` as one line and flush.

        Raises:
            ValueError: the writer is closed.
        """
        self._file.write(record.to_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file; closing twice is harmless."""
        self._file.close()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has run."""
        return self._file.closed

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def rank_metrics_path(folder: str | Path, rank: int) -> Path:
    """The metrics file of ``rank`` in run folder ``folder``: ``metrics_rank{rank}.jsonl``."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return Path(folder) / f"metrics_rank{rank}.jsonl"


def read_metrics(paths: str | Path | Iterable[str | Path]) -> list[StepRecord]:
    """Every record of one file or several, in file order then line order. Blank lines skip.

    Raises:
        ValueError: a line does not parse (the message names file and line).
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    records: list[StepRecord] = []
    for path in paths:
        with Path(path).open(encoding="utf-8") as file:
            for number, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                try:
                    records.append(StepRecord.from_json(line))
                except (ValueError, TypeError) as error:
                    raise ValueError(f"{path}:{number}: {error}") from error
    return records


def read_run(folder: str | Path) -> list[StepRecord]:
    """All ranks' records of a run folder, sorted by ``(step, rank)``.

    Where a rank's file holds a step twice (a resumed run repeats the steps after its last
    checkpoint), the record written last wins.

    Raises:
        FileNotFoundError: the folder holds no ``metrics_rank*.jsonl`` file.
        ValueError: a line does not parse, or a record's rank differs from its file's.
    """
    files = {}
    for path in Path(folder).iterdir():
        match = METRICS_FILE_PATTERN.fullmatch(path.name)
        if match:
            files[int(match.group(1))] = path
    if not files:
        raise FileNotFoundError(f"no metrics_rank*.jsonl files in {folder}")
    latest: dict[tuple[int, int], StepRecord] = {}
    for rank, path in files.items():
        for record in read_metrics(path):
            if record.rank != rank:
                raise ValueError(f"{path}: holds a record of rank {record.rank}")
            latest[(record.step, record.rank)] = record
    return [latest[key] for key in sorted(latest)]
