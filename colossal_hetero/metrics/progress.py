"""A rich progress bar for rank 0: steps done, latest loss, step time and per-rank times."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType

from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


class TrainingProgress:
    """Progress of a training run; a no-op when ``enabled`` is False (ranks other than 0).

    Use as a context manager: the bar starts on enter and is left on screen on exit. On a
    console that is not a terminal (CI logs) rich draws nothing while running and prints the
    final state once, so logs stay short.
    """

    def __init__(
        self,
        total_steps: int,
        enabled: bool = True,
        *,
        start_step: int = 0,
        description: str = "train",
        console: Console | None = None,
    ) -> None:
        """Prepare a bar of ``total_steps`` steps, ``start_step`` of them already done.

        Raises:
            ValueError: ``total_steps < 1`` or ``start_step`` outside ``[0, total_steps]``.
        """
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        if not 0 <= start_step <= total_steps:
            raise ValueError(f"start_step must be in [0, {total_steps}], got {start_step}")
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task = TaskID(0)
        if enabled:
            self._progress = _make_progress(console)
            self._task = self._progress.add_task(
                description, total=total_steps, completed=start_step, status=""
            )

    def update(
        self,
        step: int,
        loss: float | None,
        step_time: float,
        rank_step_times: Sequence[float] | None = None,
        extra: Mapping[str, float] | None = None,
    ) -> None:
        """Record that step ``step`` (0-based) finished; shows its loss, time and extras.

        ``rank_step_times[r]`` is rank ``r``'s step time, shown when given, so a straggler
        is visible live. ``extra`` values (e.g. ``{"lr": 1e-3}``) are shown as ``name=value``.
        """
        if self._progress is None:
            return
        self._progress.update(
            self._task,
            completed=step + 1,
            status=format_status(loss, step_time, rank_step_times, extra),
        )

    def log(self, message: str) -> None:
        """Print ``message`` above the bar (e.g. a validation result)."""
        if self._progress is not None:
            self._progress.console.print(message)

    def __enter__(self) -> TrainingProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()


def format_status(
    loss: float | None,
    step_time: float,
    rank_step_times: Sequence[float] | None = None,
    extra: Mapping[str, float] | None = None,
) -> str:
    """The text after the bar, e.g. ``loss 2.3456 | 0.210 s/step | ranks 0.20 0.21 | lr=0.001``."""
    parts = [f"loss {loss:.4f}" if loss is not None else "loss -", f"{step_time:.3f} s/step"]
    if rank_step_times:
        parts.append("ranks " + " ".join(f"{t:.2f}" for t in rank_step_times))
    if extra:
        parts.append(" ".join(f"{name}={value:.4g}" for name, value in extra.items()))
    return " | ".join(parts)


class _StatusProgress(Progress):
    """A progress bar with each task's status on its own line below, free to wrap."""

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            yield Text(task.fields.get("status", ""), no_wrap=False)


def _make_progress(console: Console | None) -> Progress:
    return _StatusProgress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(bar_width=30),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
        refresh_per_second=2,
    )
