"""Draw simulated kFkB timelines (one panel per k): ``python -m colossal_hetero.pipeline.plot PNG``.

Produces ``docs/images/kfkb_schedule.png``: p=4 stages, m=8 micro-batches, k in {1, 2, 4}, with
forward 1, backward 2 and a boundary latency of 1 time unit, so the panels show what grouping
buys (the fill/drain latency is paid once instead of in every steady-state round trip).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from colossal_hetero.pipeline.simulator import SimResult, Trace, simulate


def simulate_panels(
    ks: Sequence[int],
    num_stages: int = 4,
    num_microbatches: int = 8,
    forward_s: float = 1.0,
    backward_s: float = 2.0,
    latency_s: float = 1.0,
) -> dict[int, SimResult]:
    """One simulated step per ``k`` on equal stages with free links and a fixed latency."""
    p = num_stages
    return {
        k: simulate(
            [forward_s] * p,
            [backward_s] * p,
            [Trace.constant(0.0)] * (p - 1),
            num_microbatches,
            k,
            latency_s=[latency_s] * (p - 1),
        )
        for k in ks
    }


def plot_schedules(path: str, ks: Sequence[int] = (1, 2, 4)) -> None:
    """Write a PNG with one timeline panel per ``k`` (rows are stages, boxes are passes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = simulate_panels(ks)
    span = max(r.step_time for r in panels.values())
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.6 * len(panels) + 0.6), sharex=True)
    for ax, (k, result) in zip(axes, panels.items(), strict=True):
        p = len(result.busy)
        for e in result.events:
            color = "#4c78a8" if e.op == "F" else "#f58518"
            ax.barh(e.stage, e.end - e.start, left=e.start, color=color, edgecolor="white")
            ax.text((e.start + e.end) / 2, e.stage, str(e.mb), ha="center", va="center",
                    fontsize=7, color="white")  # fmt: skip
        ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
        ax.invert_yaxis()
        ax.set_xlim(0, span)
        peaks = ", ".join(str(n) for n in result.peak_in_flight)
        ax.set_title(
            f"k={k}: step {result.step_time:g}, peak in-flight per stage {peaks}",
            fontsize=9, loc="left",
        )  # fmt: skip
    axes[-1].set_xlabel("time (forward = 1, backward = 2, boundary latency = 1)")
    fig.suptitle("kFkB, p=4, m=8 (blue forward, orange backward, numbers are micro-batches)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    plot_schedules(sys.argv[1] if len(sys.argv) > 1 else "docs/images/kfkb_schedule.png")
