"""``colossal-hetero bench static``: the driver that runs the cases of ``bench/static.py`` one
spawned world at a time, shares the time budget between them, and prints and writes the report.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.table import Table

from colossal_hetero.bench import static
from colossal_hetero.bench.shaped_spawn import run_bench_ranks

QUICK_BUDGET_S = 190.0
"""Wall seconds for all cases of a ``--quick`` run (start-up comes on top: 4 minutes in all)."""
FULL_BUDGET_S = 720.0
RANK_OVERHEAD_S = 13.0
"""First guess at a case's time outside its rounds (spawn, imports, calibration, boosting)
per rank: the ranks share the machine's cores, so it grows with the world."""


def run_static_benchmark(
    *,
    quick: bool,
    json_path: str = "",
    only: str = "",
    network: Literal["model", "shaped"] = "model",
) -> int:
    """``bench static``: stock even TP against planned uneven TP and the homogeneous bound, case
    by case; print a table; write JSON to ``json_path`` when given.

    ``only`` keeps the cases whose name contains it (all when empty). ``network: shaped`` runs
    the cases that have a link on real tc-shaped links (``bench.shaped_spawn``).
    """
    selected = [
        replace(case, network_mode=network) for case in static.cases(quick) if only in case.name
    ]
    if not selected:
        raise ValueError(f"bench: --only {only!r} matches no case of static")
    console = Console()
    started = time.perf_counter()
    deadline = started + (QUICK_BUDGET_S if quick else FULL_BUDGET_S)
    rows: list[dict[str, Any]] = []
    overheads: list[float] = []
    for index, case in enumerate(selected):
        left = deadline - time.perf_counter()
        budget = _case_budget(left, selected[index:], overheads)
        case = replace(case, budget_s=budget)
        console.print(
            f"[bold]{case.name}[/]: {case.world} ranks, tp {case.tp_size}, "
            f"speeds {list(case.speeds)}, rounds budget {budget:.0f} s"
        )
        case_started = time.perf_counter()
        network_config = static.case_network(case)
        results = run_bench_ranks(static.run_case, case.world, network=network_config, case=case)
        rows.append(static.summarise(case, results[0]))
        outside = time.perf_counter() - case_started - rows[-1]["rounds"]["elapsed_s"]
        overheads.append(outside / case.world)
    report: dict[str, Any] = {
        "benchmark": "static",
        "quick": quick,
        "only": only,
        "network": network,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "summary": static.summary(rows),
        "cases": rows,
        "planning_1p5b_64_devices_s": static.planning_time_1p5b(),
    }
    report["wall_time_s"] = time.perf_counter() - started
    _print(console, report)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        console.print(f"wrote {json_path}")
    return 0


def _case_budget(left_s: float, cases: list[Any], overheads: list[float]) -> float:
    """Rounds budget of ``cases[0]``: the time left less every case's expected time outside
    its rounds (per rank, the mean of the finished cases'), shared evenly; at least 5 s (the
    minimum rounds run whatever the budget)."""
    per_rank = sum(overheads) / len(overheads) if overheads else RANK_OVERHEAD_S
    outside = sum(case.world for case in cases) * per_rank
    return max(5.0, (left_s - outside) / len(cases))


def _print(console: Console, report: dict[str, Any]) -> None:
    table = Table(
        title="bench static: median step time (s), stock even TP vs planned uneven TP; "
        "ratios with 95% intervals"
    )
    columns = ("case", "stock", "planned", "ideal", "speedup", "efficiency", "rounds", "widths")
    for column in columns:
        table.add_column(column, justify="right")
    for row in report["cases"]:
        widths = row["plan"]["widths"]
        rounds = row["rounds"]
        table.add_row(
            row["case"],
            f"{row['stock_step_time']:.3f}",
            f"{row['planned_step_time']:.3f}",
            f"{row['ideal_step_time']:.3f}",
            f"{row['speedup']:.2f}x {_ci(row['speedup_ci'])}",
            f"{row['efficiency']:.2f} {_ci(row['efficiency_ci'])}",
            f"{rounds['rounds']} +-{rounds['max_half_width']:.1%}"
            + ("" if rounds["converged"] else " (budget)"),
            "even" if widths is None else " ".join(f"{k}={list(v)}" for k, v in widths.items()),
        )
    console.print(table)
    summary = report["summary"]
    for key in ("worst_efficiency", "equal_speed_ratio"):
        if key in summary:
            console.print(
                f"{key}: {summary[key]:.3f} {_ci(summary[key + '_ci'])} ({summary[key + '_case']})"
            )
    if not summary["converged"]:
        console.print(
            f"not every ratio reached +-3% in its budget: widest +-{summary['max_half_width']:.1%}"
        )
    console.print(
        f"planning a 48-layer 1.5B GPT for 64 devices: "
        f"{report['planning_1p5b_64_devices_s']:.2f} s; total {report['wall_time_s']:.0f} s"
    )


def _ci(interval: list[float]) -> str:
    return f"[{interval[0]:.2f}, {interval[1]:.2f}]"
