"""One PNG per run: losses on top, per-rank step and compute time below."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from colossal_hetero.metrics.records import StepRecord

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def plot_run(records: Sequence[StepRecord], out_png: str | Path, title: str | None = None) -> Path:
    """Draw the run and save it to ``out_png`` (parent folders are created); returns the path.

    Top panel: training loss (one value per step, from the lowest rank that has it) and
    validation loss, against step. Bottom panel: each rank's step time (solid) and compute
    time (dashed, same colour). A rank whose compute time stands out while every rank's step
    time follows it is the straggler the others wait for.

    Uses the Agg backend, so it needs no display.

    Raises:
        ValueError: ``records`` is empty.
    """
    if not records:
        raise ValueError("no records to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, time_ax) = plt.subplots(2, 1, sharex=True, figsize=(9, 7))
    try:
        _draw_losses(loss_ax, records)
        _draw_times(time_ax, records)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        out = Path(out_png)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out


def _series(records: Sequence[StepRecord], name: str) -> tuple[list[int], list[float]]:
    """Per step, the value of ``name`` from the lowest rank that has one."""
    by_step: dict[int, float] = {}
    for r in sorted(records, key=lambda r: (r.step, r.rank)):
        value = getattr(r, name)
        if value is not None and r.step not in by_step:
            by_step[r.step] = value
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _draw_losses(ax: Axes, records: Sequence[StepRecord]) -> None:
    steps, losses = _series(records, "loss")
    ax.plot(steps, losses, label="train loss", color="tab:blue")
    val_steps, val_losses = _series(records, "val_loss")
    if val_steps:
        ax.plot(val_steps, val_losses, "o-", label="validation loss", color="tab:orange")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")


def _draw_times(ax: Axes, records: Sequence[StepRecord]) -> None:
    for rank in sorted({r.rank for r in records}):
        mine = sorted((r for r in records if r.rank == rank), key=lambda r: r.step)
        steps = [r.step for r in mine]
        color = f"C{rank % 10}"
        ax.plot(steps, [r.step_time for r in mine], color=color, label=f"rank {rank} step")
        ax.plot(
            steps, [r.compute_time for r in mine], "--", color=color, label=f"rank {rank} compute"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize="small", ncol=2)
