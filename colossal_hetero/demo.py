"""``colossal-hetero demo``: the straggler problem and its cure, on the same cluster.

configs/demo.yaml (GPT-2, TP=2 on 2 CPU ranks, rank 1 emulated 4x slower) trains twice in one
spawned world, interleaved step by step so that both see the same machine load:

- stock Colossal-AI: ``HybridParallelPlugin``, even tensor-parallel split;
- colossal_hetero: ``HeteroParallelPlugin``, which measures the devices, plans uneven widths
  and prints its plan.

Both start from the same weights and see the same batches. One table (per-rank step time and
waiting, validation loss) and one plot (runs/demo/plot.png) compare them.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from colossal_hetero.config import RunConfig, load_config

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
WARMUP = 3
VARIANTS = ("stock", "planned")
LABELS = {"stock": "stock Colossal-AI (even)", "planned": "colossal_hetero (planned)"}


def run_demo(steps: int = 0, out_dir: Path = Path("runs/demo")) -> int:
    """Train both variants of the demo config; print the comparison, write the plot and a JSON
    of the figures into ``out_dir``. Returns 0."""
    from rich.console import Console

    from colossal_hetero.bench.spawn import spawn_ranks

    if not DEMO_CONFIG.exists():
        raise FileNotFoundError(f"{DEMO_CONFIG} (run the demo from a clone of the repository)")
    config = load_config(DEMO_CONFIG)
    if steps:
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=steps))
    console = Console(width=80)
    speeds = [d.speed for d in config.cluster.devices]
    console.print(
        f"[bold]demo[/]: GPT-2, tp={config.parallel.tp} on {len(speeds)} CPU ranks, speeds "
        f"{speeds}; stock Colossal-AI and colossal_hetero, {config.train.steps} steps each, "
        "interleaved"
    )
    results = spawn_ranks(demo_rank, len(speeds), config=config)[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "demo.json").write_text(json.dumps(results, indent=1) + "\n")
    console.print(comparison_table(results, speeds))
    stock, planned = (_median_step(results[v]) for v in VARIANTS)
    console.print(
        f"colossal_hetero is {stock / planned:.2f}x faster per step "
        f"({stock:.3f} s -> {planned:.3f} s), at the same validation loss."
    )
    plot_demo(results, out_dir / "plot.png", f"same cluster (speeds {speeds}), model and data")
    console.print(f"plot: {out_dir / 'plot.png'}   figures: {out_dir / 'demo.json'}")
    return 0


def demo_rank(rank: int, world_size: int, device: torch.device, config: RunConfig) -> dict:
    """Spawned on every rank: boost both variants, train them interleaved, evaluate.

    Returns (identical on every rank) per variant: per-step rows of every rank's step time,
    compute time, waiting and training loss, and the validation losses by step.
    """
    from colossalai.booster.plugin import HybridParallelPlugin

    from colossal_hetero.bench.measure import TrainingRunner
    from colossal_hetero.data import build_data
    from colossal_hetero.emulation import build_interceptor
    from colossal_hetero.plugin import HeteroParallelPlugin, prepare_device
    from colossal_hetero.plugin.engine import engine_kwargs

    prepare_device(device)
    hetero_config = config.plugin_config()
    even = dataclasses.replace(hetero_config, plan=dataclasses.replace(config.plan, mode="even"))
    batch, seq = config.data.global_batch_size, config.data.seq_len
    shape: dict[str, Any] = {"batch_size": batch, "seq_len": seq, "device": device}
    stock_timer = build_interceptor(hetero_config.emulation, rank, world_size, device)
    stock = TrainingRunner(
        config.model,
        HybridParallelPlugin(**engine_kwargs(even, device)),
        stock_timer,
        emulated=hetero_config.emulation.enabled,
        **shape,
    )
    plugin = HeteroParallelPlugin(hetero_config, workload=(batch, seq))
    planned = TrainingRunner(config.model, plugin, plugin.timer, **shape)
    runners = {"stock": stock, "planned": planned}
    data = build_data(config.data, config.model.arch)
    val = data.val_batches(batch, config.train.eval_batches)
    val_losses: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    for step in range(config.train.steps):
        order = list(VARIANTS) if step % 2 == 0 else list(reversed(VARIANTS))
        train_batch = data.train_batch(step, batch, config.data.seed)
        for name in order:
            runners[name].step(step, record=step >= WARMUP, batch=train_batch)
        if (step + 1) % config.train.eval_every == 0 or step + 1 == config.train.steps:
            for name in VARIANTS:
                val_losses[name].append([step + 1, _validation_loss(runners[name], val, device)])
    out: dict[str, Any] = {
        name: {"rows": runner.rows, "val_losses": val_losses[name]}
        for name, runner in runners.items()
    }
    out["plan_widths"] = {k: list(v) for k, v in plugin.plan.widths.items()} if plugin.plan else {}
    for runner in runners.values():
        getattr(runner, "close", lambda: None)()  # runners detach the timers they installed
    plugin.close()
    return out


def _validation_loss(runner: Any, batches: list[dict], device: torch.device) -> float:
    """Mean loss over ``batches`` (forward only, every rank takes part in the TP collectives)."""
    runner.model.eval()
    losses = []
    with torch.no_grad():
        for batch in batches:
            on_device = {k: v.to(device) for k, v in batch.items()}
            losses.append(float(runner.criterion(runner.model(**on_device), on_device)))
    runner.model.train()
    return sum(losses) / len(losses)


def _per_rank(rows: list[list[float]], column: int) -> list[float]:
    """Per rank, the median of ``column`` (0 step, 1 compute, 2 waiting, 3 loss) over steps."""
    ranks = len(rows[0]) // 4
    return [statistics.median(row[4 * r + column] for row in rows) for r in range(ranks)]


def _median_step(result: dict) -> float:
    """Median over steps of the slowest rank's step time (the step is synchronous)."""
    rows = result["rows"]
    return statistics.median(max(row[0::4]) for row in rows)


def comparison_table(results: dict, speeds: list[float]) -> Any:
    """One rich table: per rank, each variant's median step time and waiting; validation
    loss and the step time of the slowest rank below."""
    from rich.table import Table

    table = Table(title="median seconds per step (per rank), last validation loss")
    table.add_column("rank", justify="right")
    table.add_column("speed", justify="right")
    for name in VARIANTS:
        table.add_column(f"{name}\nstep", justify="right")
        table.add_column(f"{name}\nwaiting", justify="right")
    if results.get("plan_widths"):
        table.add_column("planned\nheads/ffn", justify="right")
    widths = results.get("plan_widths", {})
    cells = {
        name: (_per_rank(results[name]["rows"], 0), _per_rank(results[name]["rows"], 2))
        for name in VARIANTS
    }
    for rank, speed in enumerate(speeds):
        row = [str(rank), f"{speed:g}"]
        for name in VARIANTS:
            step, wait = cells[name][0][rank], cells[name][1][rank]
            row += [f"{step:.3f}", f"{wait:.3f} {wait / step:>4.0%}"]
        if widths:
            row.append(f"{widths['heads'][rank]}/{widths['ffn'][rank]}")
        table.add_row(*row)
    table.add_section()
    last = [results[name]["val_losses"][-1][1] for name in VARIANTS]
    table.add_row(
        "all", "", f"{_median_step(results['stock']):.3f}", f"val {last[0]:.3f}",
        f"{_median_step(results['planned']):.3f}", f"val {last[1]:.3f}",
        *([""] if widths else []),
    )  # fmt: skip
    return table


def plot_demo(results: dict, out_png: Path, title: str = "") -> Path:
    """Step time of the slowest rank per step (top) and validation loss (bottom), both
    variants; Agg backend, no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (time_ax, loss_ax) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    try:
        for name, colour in zip(VARIANTS, ("tab:red", "tab:green"), strict=True):
            rows = results[name]["rows"]
            steps = list(range(WARMUP + 1, WARMUP + 1 + len(rows)))
            time_ax.plot(steps, [max(row[0::4]) for row in rows], color=colour, label=LABELS[name])
            points = results[name]["val_losses"]
            loss_ax.plot(*zip(*points, strict=True), "o-", color=colour, label=LABELS[name])
        time_ax.set_ylabel("step time, s (slowest rank)")
        time_ax.set_ylim(bottom=0)
        loss_ax.set_ylabel("validation loss")
        loss_ax.set_xlabel("step")
        time_ax.legend()
        loss_ax.legend()
        fig.suptitle(title)
        fig.tight_layout()
        out_png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_png, dpi=100)
    finally:
        plt.close(fig)
    return out_png
