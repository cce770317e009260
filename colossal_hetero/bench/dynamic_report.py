"""``bench dynamic``: the console tables, the Markdown table and the plots of a report.

``python -m colossal_hetero.bench.dynamic_report REPORT.json OUT_DIR`` writes the plots
(``balancing_step_times.png``, ``balancing_decisions.png``) and prints the Markdown table
of a saved report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SUMMARY_KEYS = (
    "semi_min_efficiency",
    "semi_min_slowdown_removed",
    "semi_speedup_in_4x_phase",
    "migrate_max_loss_diff",
    "replan_max_loss_diff",
    "resize_digits_accuracy_drop",
    "semi_digits_accuracy_drop",
    "semi_text_val_loss_increase",
    "max_detection_delay_steps",
)


def _ci(figure: dict[str, Any] | None, fmt: str = "{:.2f}") -> str:
    if figure is None:
        return "-"
    low, high = figure["ci"]
    return f"{fmt.format(figure['value'])} [{fmt.format(low)}, {fmt.format(high)}]"


def table_rows(row: dict[str, Any]) -> list[list[str]]:
    """One model's table: per variant and phase, median step, efficiency, speedup vs stock,
    slowdown removed, detection delay, kB sent per step, last validation loss of the phase."""
    out = []
    variants = list(next(iter(row["phases"].values())))
    for phase, figures in row["phases"].items():
        for index, name in enumerate(variants):
            f = figures[name]
            delay = row["delays"].get(name, {}).get(phase, "-")
            evals = [e for e in row["val_losses"][name] if e[0] <= row["phase_steps"][phase][1]]
            out.append(
                [
                    phase if index == 0 else "",
                    name,
                    _ci(f["step_time"], "{:.3f}"),
                    f"{f['ideal_step_time']['value']:.3f}",
                    _ci(f["efficiency"]),
                    _ci(f["speedup_vs_stock"]),
                    _ci(f["slowdown_removed"]) if name != "unperturbed" else "-",
                    "-" if delay is None and name not in row["delays"] else str(delay),
                    f"{f['bytes_per_step'] / 1e3:.0f}",
                    f"{evals[-1][1]:.4f}" if evals else "-",
                ]
            )
    return out


HEADERS = (
    "phase",
    "variant",
    "median step s [95% CI]",
    "ideal s",
    "efficiency",
    "speedup vs stock",
    "slowdown removed",
    "detect delay",
    "kB/step",
    "val loss",
)


def markdown(report: dict[str, Any]) -> str:
    """The benchmark tables as Markdown (one per model, then the accuracy run)."""
    lines = []
    for row in report["throughput"]:
        lines += [f"**{row['model']}**", "", "| " + " | ".join(HEADERS) + " |"]
        lines.append("|" + "---|" * len(HEADERS))
        lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(row)]
        lines.append("")
    accuracy = report.get("accuracy")
    if accuracy:
        lines += ["| digits variant | held-out accuracy | drop (points) |", "|---|---|---|"]
        for name, value in accuracy["accuracy"].items():
            drop = accuracy["drop_points"].get(name)
            lines.append(f"| {name} | {value:.4f} | {'-' if drop is None else f'{drop:.2f}'} |")
    return "\n".join(lines) + "\n"


def print_report(console: Any, report: dict[str, Any]) -> None:
    """Quiet console output: one table per model, the accuracy table and the summary."""
    from rich.table import Table

    for row in report["throughput"]:
        fraction = row.get("compute_fraction")
        share = f"; compute {fraction:.2f} of an unperturbed step" if fraction else ""
        table = Table(title=f"bench dynamic, {row['model']}: per phase, 95% intervals{share}")
        for header in HEADERS:
            table.add_column(header, justify="right")
        for cells in table_rows(row):
            table.add_row(*cells)
        console.print(table)
    accuracy = report.get("accuracy")
    if accuracy:
        drops = accuracy["drop_points"]
        console.print(
            "digits accuracy: "
            + ", ".join(f"{k} {v:.3f}" for k, v in accuracy["accuracy"].items())
            + ("; drop (points): " + ", ".join(f"{k} {v:.2f}" for k, v in drops.items()))
        )
    summary = report["summary"]
    for key in SUMMARY_KEYS:
        value = summary.get(key)
        why = summary["reasons"].get(key, "")
        console.print(f"{key}: {value}" + (f"  ({why})" if why else ""))
    load = report.get("load_average_1min")
    console.print(f"total {report['wall_time_s']:.0f} s; host load average at the end: {load}")


def plot_step_times(report: dict[str, Any], out_png: Path, model: int = 0) -> Path:
    """Per-rank compute time per step, stock even TP (``none``) vs each balancer mode, with
    the phase boundaries: before balancing one rank computes longest while the others wait;
    after, the times come together."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    row = report["throughput"][model]
    raw = report["raw"]["throughput"][model]["variants"]
    shown = [n for n in ("none", "replan", "semi", "resize", "migrate", "oracle") if n in raw]
    fig, axes = plt.subplots(len(shown), 1, sharex=True, figsize=(8, 2.2 * len(shown)))
    try:
        for ax, name in zip(axes, shown, strict=True):
            rows = raw[name]["rows"]
            ranks = len(rows[0]) // 4
            for r in range(ranks):
                ax.plot([x[4 * r + 1] for x in rows], label=f"rank {r}", lw=1)
            ax.plot([max(x[0::4]) for x in rows], "k--", lw=1, label="step (slowest)")
            for start, _ in row["phase_steps"].values():
                ax.axvline(start, color="grey", lw=0.5)
            ax.set_ylabel(f"{name}\ns")
            ax.set_ylim(bottom=0)
        axes[0].legend(fontsize=7, ncol=5, loc="upper left")
        axes[-1].set_xlabel("step (grey: phase starts)")
        fig.suptitle(f"{row['model']}: per-rank compute time per step")
        fig.tight_layout()
        fig.savefig(out_png, dpi=90)
    finally:
        plt.close(fig)
    return out_png


def plot_decisions(report: dict[str, Any], out_png: Path, model: int = 0) -> Path:
    """From the decision records, per balanced mode and rank: the kept fraction of the
    reduction columns (solid; ZERO-resizing drops the rest) and the part of an even split's
    work the rank computes itself (dashed: its width share less what it drops or migrates),
    after each agreement; the executed action is written at the bottom when it changed
    something."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    row = report["throughput"][model]
    raw = report["raw"]["throughput"][model]["variants"]
    modes = [m for m in ("replan", "resize", "migrate", "semi") if m in raw]
    fig, axes = plt.subplots(len(modes), 1, sharex=True, figsize=(8, 2.4 * max(len(modes), 1)))
    axes = axes if len(modes) > 1 else [axes]
    try:
        for ax, mode in zip(axes, modes, strict=True):
            records = [r for r in raw[mode]["records"] if "stragglers" in r.get("inputs", {})]
            steps = [r["step"] for r in records]
            states = [decision_state(r) for r in records]
            for rank in range(len(states[0][0]) if states else 0):
                line = ax.step(steps, [s[0][rank] for s in states], where="post", lw=1.2)
                colour = line[0].get_color()
                ax.step(steps, [s[1][rank] for s in states], "--", where="post", lw=1,
                        color=colour, label=f"rank {rank}")  # fmt: skip
            for step, record in zip(steps, records, strict=True):
                action = record["decision"].get("action", "none")
                if action not in ("none", "keep"):
                    label = record["decision"].get("executed", action)
                    ax.annotate(label, (step, 0.03), fontsize=6, rotation=90)
            for start, _ in row["phase_steps"].values():
                ax.axvline(start, color="grey", lw=0.5)
            ax.set_ylabel(f"{mode}\nkept / own work")
            ax.set_ylim(bottom=0)
        if modes:
            axes[0].legend(fontsize=7, ncol=4, loc="upper right")
            axes[-1].set_xlabel("step of the decision record (grey: phase starts)")
        fig.suptitle(f"{row['model']}: kept fraction (solid) and own work (dashed) per rank")
        fig.tight_layout()
        fig.savefig(out_png, dpi=90)
    finally:
        plt.close(fig)
    return out_png


def decision_state(record: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Per rank after the record: (kept fraction, own work relative to an even split).

    The in-layer plan is the decision's when it attached one (``offloads``), else the one
    attached before (``inputs.attached``); widths are the decision's when it moved them.
    """
    decision, inputs = record["decision"], record["inputs"]
    plan = decision if "offloads" in decision else inputs.get("attached") or {}
    widths = decision.get("widths") or inputs.get("widths") or {}
    ranks = len(inputs["slowdown"])
    share = [1.0] * ranks
    if widths:
        share = [
            sum(v[r] / sum(v) * ranks for v in widths.values()) / len(widths) for r in range(ranks)
        ]
    kept, own = [1.0] * ranks, list(share)
    for offload in plan.get("offloads", []):
        r = offload["rank"]
        kept[r] = 1.0 - offload["dropped"]
        own[r] = share[r] * (1.0 - offload["dropped"] - offload["migrated"])
    return kept, own


def main(argv: list[str]) -> int:
    """``REPORT.json OUT_DIR``: write the plots, print the Markdown table."""
    report = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    plot_step_times(report, out / "balancing_step_times.png")
    plot_decisions(report, out / "balancing_decisions.png")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
