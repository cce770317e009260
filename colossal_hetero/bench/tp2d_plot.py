"""Figures of docs/tp2d.md from a ``bench tp2d`` JSON report.

``python -m colossal_hetero.bench.tp2d_plot REPORT.json OUT_DIR`` writes

- ``tp2d_mesh.png``: the 2 x 2 mesh, even and resized for the report's speeds; each block is
  drawn as wide as its column's heads and as tall as its row's batch share, so its area is
  the rank's work (b_i a_j), with the device and its emulated speed inside;
- ``tp2d_memory.png``: activation bytes per rank, measured and as the planner predicts,
  for 1D, 1D with sequence parallelism and 2D, and the largest batch under the budget.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MIB = 2**20


def draw_mesh(
    ax: Any,
    batch: list[int],
    heads: list[int],
    positions: list[int],
    speeds: list[float],
    title: str,
    fixed: float = 0.0,
) -> None:
    """One mesh: column j spans heads[j], row i spans batch[i] (row 0 on top); a block's time
    is (fixed + batch x heads) / speed."""
    q = len(batch)
    x0 = [sum(heads[:j]) for j in range(q)]
    y_top = sum(batch)
    for i in range(q):
        for j in range(q):
            device = positions[i * q + j]
            speed = speeds[device]
            work = (fixed + batch[i] * heads[j]) / speed
            y = y_top - sum(batch[: i + 1])
            colour = "#f4a582" if speed < max(speeds) else "#92c5de"
            ax.add_patch(_rect(ax, (x0[j], y), heads[j], batch[i], colour))
            ax.text(
                x0[j] + heads[j] / 2,
                y + batch[i] / 2,
                f"rank {device}\nspeed {speed:g}\n{batch[i]} x {heads[j]}\ntime {work:.3g}",
                ha="center",
                va="center",
                fontsize=8,
            )
    ax.set_xlim(0, sum(heads))
    ax.set_ylim(0, y_top)
    ax.set_xlabel("heads per mesh column (hidden, MLP, vocab follow)")
    ax.set_ylabel("samples per mesh row")
    ax.set_title(title, fontsize=9)


def _rect(ax: Any, xy: tuple[float, float], w: float, h: float, colour: str) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle(xy, w, h, facecolor=colour, edgecolor="black", linewidth=1.5)


def plot(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write both figures; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    case, plan = report["case"], report["resized_plan"]
    speeds, batch, heads = list(case["speeds"]), case["batch_size"], case["heads"]
    even_b, even_a = [batch // 2] * 2, [heads // 2] * 2
    fixed = float(plan.get("overhead_sample_heads", 0.0))  # each rank's fixed work
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    slow_even = max((fixed + even_b[0] * even_a[0]) / s for s in speeds)
    draw_mesh(
        axes[0],
        even_b,
        even_a,
        [0, 1, 2, 3],
        speeds,
        f"even 2D: slowest block {slow_even:.3g}",
        fixed,
    )
    slow = max(
        (fixed + plan["batch_sizes"][p // 2] * plan["head_counts"][p % 2]) / speeds[d]
        for p, d in enumerate(plan["positions"])
    )
    draw_mesh(
        axes[1],
        plan["batch_sizes"],
        plan["head_counts"],
        plan["positions"],
        speeds,
        f"resized 2D: slowest block {slow:.3g} ({plan['predicted_speedup']:.2f}x predicted)",
        fixed,
    )
    title = "2 x 2 SUMMA mesh: rows share the batch, columns the heads (area = work)"
    if fixed:
        title += f"\ntime = ({fixed:.3g} fixed + samples x heads) / speed, fixed work measured"
    fig.suptitle(title)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    mesh_path = out_dir / "tp2d_mesh.png"
    fig.savefig(mesh_path, dpi=110)
    plt.close(fig)
    return [mesh_path, _memory_figure(report, out_dir, plt)]


def _memory_figure(report: dict[str, Any], out_dir: Path, plt: Any) -> Path:
    names = ["1d", "1d_sp", "2d"]
    memory, predicted = report["memory"], report["summary"]["cost_model_bytes"]
    measured = [memory[n]["activation_bytes"] / MIB for n in names]
    model = [predicted[n] / MIB for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    xs = range(len(names))
    axes[0].bar([x - 0.2 for x in xs], measured, 0.4, label="measured")
    axes[0].bar([x + 0.2 for x in xs], model, 0.4, label="planner model")
    axes[0].set_xticks(list(xs), ["1D", "1D + SP", "2D"])
    axes[0].set_ylabel("MiB per rank")
    axes[0].set_title(f"activations, batch {report['case']['batch_size']}", fontsize=9)
    axes[0].legend(fontsize=8)
    axes[1].bar(list(xs), [memory[n]["max_batch"] for n in names], 0.5, color="#4d9221")
    axes[1].set_xticks(list(xs), ["1D", "1D + SP", "2D"])
    axes[1].set_title(f"largest batch within {memory['budget_mib']:g} MiB per rank", fontsize=9)
    fig.tight_layout()
    path = out_dir / "tp2d_memory.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    written = plot(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
    print(" ".join(str(p) for p in written))
