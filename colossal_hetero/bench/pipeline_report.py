"""Tables and the trace plot of ``bench pipeline`` (from its worker results / JSON report).

``python -m colossal_hetero.bench.pipeline_report REPORT.json OUT.png`` draws, per layout, the
ada variant's ``k`` and the throughput of ada, Colossal-AI's 1F1B and each static ``k`` over
phase (b)'s rounds, with the preempted rounds shaded.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

_MIB = 2**20


def _variants(series: dict[str, list[float]]) -> list[str]:
    return list(dict.fromkeys(key.split(".")[0] for key in series))


def variant_table(spec: dict[str, Any], result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per phase and variant: median samples/s (and its 95% interval from the median
    step time's), each stage's peak activation MiB (largest over rounds), the k it ran (ada:
    each round's), and the simulator's median relative error (kFkB variants)."""
    rows = []
    for phase, data in result["phases"].items():
        series, medians = data["series"], data["medians"]
        preempted = None
        if phase == "b":
            first = data["first_round"]
            preempted = [i for i in range(data["rounds"]) if spec["shares"][first + i] < 1.0]
        for name in _variants(series):
            step = medians[f"{name}.step"]
            mems = sorted(key for key in series if key.startswith(f"{name}.mem"))
            row: dict[str, Any] = {
                "phase": phase,
                "variant": name,
                "samples_per_s": spec["batch_size"] / step["value"],
                "samples_per_s_ci": [spec["batch_size"] / x for x in reversed(step["ci"])],
                "peak_activation_mib": [max(series[key]) / _MIB for key in mems],
                "k": sorted({int(x) for x in series[f"{name}.k"]}),
            }
            if name == "ada":
                row["k_by_round"] = [int(x) for x in series["ada.k"]]
            if preempted:
                steps = [series[f"{name}.step"][i] for i in preempted]
                row["samples_per_s_preempted"] = spec["batch_size"] / statistics.median(steps)
            if f"{name}.sim" in series:
                pairs = zip(series[f"{name}.sim"], series[f"{name}.meas"], strict=True)
                row["sim_error"] = statistics.median(abs(s - p) / p for s, p in pairs)
            rows.append(row)
    return rows


def print_report(console: Any, report: dict[str, Any]) -> None:
    """The per-layout tables and the summary line."""
    from rich.table import Table

    for name, layout in report["layouts"].items():
        table = Table(title=f"bench pipeline {name}: samples/s (median)")
        for column in ("variant", "a", "b preempted", "c", "peak MiB per stage (a)", "k", "sim"):
            table.add_column(column, justify="right")
        by: dict[str, dict[str, Any]] = {}
        for row in layout["table"]:
            by.setdefault(row["variant"], {})[row["phase"]] = row
        for variant, phases in by.items():
            a, b, c = phases.get("a", {}), phases.get("b", {}), phases.get("c", {})
            sim = [p["sim_error"] for p in phases.values() if "sim_error" in p]
            table.add_row(
                variant,
                f"{a.get('samples_per_s', float('nan')):.1f}",
                f"{b.get('samples_per_s_preempted', float('nan')):.1f}",
                f"{c.get('samples_per_s', float('nan')):.1f}",
                " ".join(f"{m:.2f}" for m in a.get("peak_activation_mib", [])),
                ",".join(map(str, b.get("k_by_round", b.get("k", [])))),
                f"{max(sim):.0%}" if sim else "-",
            )
        console.print(table)
        split = layout["result"].get("measured_split")
        if split:  # case (c): the split planned from the stages' measured times
            console.print(
                f"(c) planned split {split['split']} from block ms "
                f"{[round(b * 1e3, 2) for b in split['block_s']]}, fixed ms "
                f"{[round(f * 1e3, 2) for f in split['fixed_s']]}"
            )
    console.print(" ".join(f"{k}={_show(v)}" for k, v in report["summary"].items()))
    console.print(f"total {report['wall_time_s']:.0f} s")


def _show(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def plot_trace(report: dict[str, Any], out: str) -> None:
    """k and throughput over phase (b)'s rounds, one column per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = report["layouts"]
    fig, axes = plt.subplots(2, len(layouts), figsize=(6 * len(layouts), 6), squeeze=False)
    for col, (name, layout) in enumerate(layouts.items()):
        spec, data = layout["spec"], layout["result"]["phases"]["b"]
        series, first = data["series"], data["first_round"]
        rounds = list(range(first, first + data["rounds"]))
        top, bottom = axes[0][col], axes[1][col]
        for start, end, share in _stretches(spec["shares"], rounds):
            for ax in (top, bottom):
                ax.axvspan(start - 0.5, end - 0.5, color="tab:red", alpha=0.12, lw=0)
            top.annotate(
                f"tenant {1 - share:.0%}",
                ((start + end - 1) / 2, 1.0),
                xycoords=("data", "axes fraction"),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        for variant in _variants(series):
            style = {"lw": 2.2} if variant == "ada" else {"lw": 1.0, "alpha": 0.8}
            samples = [spec["batch_size"] / t for t in series[f"{variant}.step"]]
            top.plot(rounds, samples, marker="o", ms=3, label=variant, **style)
        bottom.step(rounds, series["ada.k"], where="mid", color="black", label="ada k")
        bottom.set_yticks(range(1, int(max(series["ada.k"])) + 2))
        top.set_title(f"{name}: throughput over the preemption trace", pad=14)
        top.set_ylabel("samples/s")
        bottom.set_ylabel("ada's k")
        bottom.set_xlabel("round (job step reported to the shaped launcher)")
        top.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _stretches(shares: list[float], rounds: list[int]) -> list[tuple[int, int, float]]:
    """(first round, end round, share) of each run of preempted rounds among ``rounds``."""
    runs: list[tuple[int, int, float]] = []
    for r in rounds:
        share = shares[r]
        if share >= 1.0:
            continue
        if runs and runs[-1][1] == r and runs[-1][2] == share:
            runs[-1] = (runs[-1][0], r + 1, share)
        else:
            runs.append((r, r + 1, share))
    return runs


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m colossal_hetero.bench.pipeline_report REPORT.json OUT.png")
        return 2
    plot_trace(json.loads(Path(args[0]).read_text()), args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
