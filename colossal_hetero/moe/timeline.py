"""Timeline picture of one step's a2a calls, pending spans and gradient chunks (PNG).

Input: step logs as :meth:`.comm.MoeComm.step_log` gives them (``moe_rank{r}.jsonl`` holds
one per step under ``events``), one panel per log, e.g. priority off and on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_ROWS = (("pending", "ep"), ("a2a", "ep"), ("chunk", "dense"), ("chunk", "expert"))
_LABELS = ("a2a pending", "a2a calls", "dense chunks", "expert chunks")
_COLOURS = ("#d9d9d9", "#d62728", "#1f77b4", "#2ca02c")


def plot_timelines(logs: Mapping[str, Sequence[Sequence[Any]]], path: str | Path) -> None:
    """Write a PNG with one panel per named step log (rows: spans, a2a, dense and expert
    chunks; a chunk's bar ends when its completion was observed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(logs), 1, figsize=(10, 1.6 + 1.4 * len(logs)), squeeze=False)
    end = max((float(row[4]) for log in logs.values() for row in log), default=1.0)
    for ax, (title, log) in zip(axes[:, 0], logs.items(), strict=True):
        for y, ((kind, group), colour) in enumerate(zip(_ROWS, _COLOURS, strict=True)):
            bars = [
                (float(row[3]) * 1e3, max(float(row[4]) - float(row[3]), 1e-5) * 1e3)
                for row in log
                if row[0] == kind and row[1] == group
            ]
            ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=colour, edgecolor="black", lw=0.3)
        ax.set_yticks(range(len(_ROWS)), _LABELS)
        ax.set_xlim(0, end * 1e3 * 1.02)
        ax.set_title(title, fontsize=10)
    axes[-1, 0].set_xlabel("ms since the step's first event")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
