"""``colossal-hetero demo``: the straggler problem, measured.

Trains configs/demo.yaml (GPT-2, TP=2 x PP=2, 4 CPU ranks, rank 3 emulated 2x slower), then
prints per-rank medians from the metrics JSONL and points at the plot.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from colossal_hetero.cli import launch
from colossal_hetero.config import dump_config, load_config
from colossal_hetero.metrics import read_run, summarize

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def run_demo(steps: int = 0, out_dir: Path = Path("runs/demo")) -> int:
    """Train the demo config into ``out_dir``; returns the trainer's exit status."""
    if not DEMO_CONFIG.exists():
        raise FileNotFoundError(f"{DEMO_CONFIG} (run the demo from a clone of the repository)")
    config = load_config(DEMO_CONFIG)
    train = dataclasses.replace(config.train, steps=steps) if steps else config.train
    logging = dataclasses.replace(config.logging, dir=str(out_dir))
    config = dataclasses.replace(config, train=train, logging=logging)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("metrics_rank*.jsonl"):
        old.unlink()
    console = Console()
    console.print(
        f"[bold]demo[/]: GPT-2, tp=2 x pp=2 on 4 CPU ranks, rank 3 emulated 2x slower, "
        f"{config.train.steps} steps"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        handle.write(dump_config(config))
    status = launch(handle.name, nproc=4)
    Path(handle.name).unlink()
    if status != 0:
        return status
    _print_summary(console, out_dir, config.emulation.compute)
    return 0


def _print_summary(console: Console, out_dir: Path, slowdowns: list) -> None:
    summary = summarize(read_run(out_dir))
    factors = {s.rank: s.factor for s in slowdowns}
    table = Table(title="per-rank medians (seconds)")
    for column in ("rank", "emulated slowdown", "step time", "compute", "comm wait"):
        table.add_column(column, justify="right")
    for rank, stats in sorted(summary["ranks"].items()):
        table.add_row(
            str(rank),
            f"{factors.get(int(rank), 1.0):g}x",
            f"{stats['step_time']:.3f}",
            f"{stats['compute_time']:.3f}",
            f"{stats['comm_wait']:.3f}",
        )
    console.print(table)
    fast = [stats for rank, stats in summary["ranks"].items() if int(rank) not in factors]
    if fast and factors:
        waited = sum(s["comm_wait"] / s["step_time"] for s in fast) / len(fast)
        console.print(
            f"the ranks at full speed spend {waited:.0%} of each step waiting in collectives: "
            f"the slow rank sets everyone's pace"
        )
    console.print(
        f"median step time {summary['median_step_time']:.3f} s; "
        f"last validation loss {summary['last_val_loss']:.4f}"
    )
    console.print(f"metrics: {out_dir}/metrics_rank*.jsonl   plot: {out_dir / 'plot.png'}")
