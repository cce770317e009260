"""Benchmarks: ``colossal-hetero bench NAME [--quick] [--json PATH]``.

Each compares against stock Colossal-AI in the same run and reports medians and ratios.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def run_benchmark(name: str, *, quick: bool, json_path: str = "", only: str = "") -> int:
    """Run benchmark ``name``; print a table; write JSON to ``json_path`` when given.

    ``only`` keeps the cases whose name contains it (all when empty).
    """
    if name == "network":  # shaped links against the network model (no stock baseline)
        from colossal_hetero.bench.network import run_network_benchmark

        return run_network_benchmark(quick=quick, json_path=json_path)
    if name != "static":
        raise ValueError(f"bench: unknown benchmark {name!r}; known: static")
    from colossal_hetero.bench import static
    from colossal_hetero.bench.spawn import spawn_ranks

    selected = [case for case in static.cases(quick) if only in case.name]
    if not selected:
        raise ValueError(f"bench: --only {only!r} matches no case of {name}")
    console = Console()
    started = time.perf_counter()
    rows = []
    for case in selected:
        console.print(
            f"[bold]{case.name}[/]: {case.world} ranks, tp {case.tp_size}, "
            f"speeds {list(case.speeds)}"
        )
        results = spawn_ranks(static.run_case, case.world, case=case)
        rows.append(static.summarise(case, results[0]))
    report: dict[str, Any] = {
        "benchmark": "static",
        "quick": quick,
        "only": only,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "cases": rows,
        "planning_1p5b_64_devices_s": static.planning_time_1p5b(),
    }
    report["wall_time_s"] = time.perf_counter() - started
    _print(console, report)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        console.print(f"wrote {json_path}")
    return 0


def _print(console: Console, report: dict[str, Any]) -> None:
    table = Table(title="bench static: median step time (s), stock even TP vs planned uneven TP")
    for column in ("case", "stock", "planned", "ideal", "speedup", "efficiency", "widths"):
        table.add_column(column, justify="right")
    for row in report["cases"]:
        widths = row["plan"]["widths"]
        table.add_row(
            row["case"],
            f"{row['stock_step_time']:.3f}",
            f"{row['planned_step_time']:.3f}",
            f"{row['ideal_step_time']:.3f}",
            f"{row['speedup']:.2f}x",
            f"{row['efficiency']:.2f}",
            "even" if widths is None else " ".join(f"{k}={list(v)}" for k, v in widths.items()),
        )
    console.print(table)
    console.print(
        f"planning a 48-layer 1.5B GPT for 64 devices: "
        f"{report['planning_1p5b_64_devices_s']:.2f} s; total {report['wall_time_s']:.0f} s"
    )
