"""``colossal-hetero bench network``: shaped links against the network model and the rate.

Each phase of ``network_patterns`` runs twice: on real shaped links (the shaped launcher, one
namespace per rank) and on loopback under the interceptor's network model (``emulation.network
.mode: model``), with the same rate and preemptions. Every pattern is repeated and reported as
its median, next to what the configured rate predicts:

| pattern | rate prediction (``R`` bits/s, ``B`` bytes of each rank's input, 2 ranks) |
|---|---|
| all-reduce | ``B / R`` (ring: ``2(n-1)/n * B``) |
| p2p | ``B / R`` |
| all-to-all | ``B / 2 / R`` (half of the input crosses the link) |
| small all-to-all behind an all-reduce | ``B / 2 / (R / 2)``: a fair share of the link |
| p2p during a rate change to ``f`` | ``B / (f R)`` into the targeted rank, ``B / R`` elsewhere |
| p2p during a tenant burst leaving ``f`` | ``B / (f R)`` (TCP's fair share), ``B / R`` elsewhere |

``shaped_rate_max_error`` covers the patterns whose time the rate defines (alone, rate change,
and the untargeted side of the tenant burst); the contention and the tenant's share are set by
TCP and the queue, and are reported, not held to the rate. ``model_vs_shaped_max_error``
covers every pattern but the tenant's target: there the model applies the configured factor
while the shaped run has real TCP competition, which is the point of a tenant (its error is
reported as ``tenant_model_vs_shaped_error``).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from colossal_hetero.bench.network_patterns import Phase, run_patterns
from colossal_hetero.bench.shaped_spawn import run_bench_ranks, run_shaped_ranks

_MIB = 1 << 20
RATE_GBPS = 0.2
PREEMPT_FACTOR = 0.5
SHAPED_TIMEOUT_S = 300.0


def phases(quick: bool) -> list[Phase]:
    """The two launches: 2 ranks for the patterns alone and in contention, 3 for preemption."""
    repeats = 3 if quick else 15
    preemptions = [
        {"factor": PREEMPT_FACTOR, "start_step": 1, "end_step": 2, "ranks": [2]},
        {"factor": PREEMPT_FACTOR, "start_step": 2, "end_step": 3, "ranks": [2], "kind": "tenant"},
    ]
    return [
        Phase(name="alone", world=2, rate_gbps=RATE_GBPS, repeats=repeats),
        Phase(
            name="preempt", world=3, rate_gbps=RATE_GBPS, repeats=repeats, preemptions=preemptions
        ),
    ]


def predictions(phase: Phase) -> dict[str, float]:
    """Seconds the configured rate predicts for each pattern of ``phase`` (table above)."""
    rate = phase.rate_gbps * 1e9 / 8  # bytes/s
    mib = _MIB
    if phase.name == "alone":
        return {
            "allreduce": phase.allreduce_mib * mib / rate,
            "p2p": phase.p2p_mib * mib / rate,
            "alltoall": phase.alltoall_mib * mib / 2 / rate,
            "small_alltoall_alone": phase.small_alltoall_mib * mib / 2 / rate,
            "small_alltoall_behind": phase.small_alltoall_mib * mib / 2 / (rate / 2),
        }
    p2p = phase.p2p_mib * mib / rate
    out = {f"{label}_other": p2p for label in ("before", "rate_change", "tenant")}
    out["before_target"] = p2p
    out["rate_change_target"] = p2p / PREEMPT_FACTOR
    out["tenant_target"] = p2p / PREEMPT_FACTOR
    return out


RATE_DEFINED = (
    "allreduce",
    "p2p",
    "alltoall",
    "before_target",
    "before_other",
    "rate_change_target",
    "rate_change_other",
    "tenant_other",
)
"""Patterns whose time the configured rate alone defines (``shaped_rate_max_error``)."""


def _pooled(results: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Every repeat's seconds per pattern, over the rank that timed it."""
    merged: dict[str, list[float]] = {}
    for result in results:
        for name, times in result.items():
            merged.setdefault(name, []).extend(times)
    return merged


def _merge(results: list[dict[str, list[float]]]) -> dict[str, float]:
    """Median per pattern over the rank that timed it."""
    return {name: statistics.median(times) for name, times in _pooled(results).items()}


def run_shaped_repeats(phase: Phase) -> tuple[dict[str, list[float]], int]:
    """Every repeat's seconds on shaped links, and how many of the launch's namespaces remain
    afterwards."""
    results, leftovers = run_shaped_ranks(
        run_patterns,
        phase.world,
        phase.network("shaped"),
        timeout_s=SHAPED_TIMEOUT_S,
        phase=asdict(phase),
        mode="shaped",
    )
    return _pooled(results), leftovers


def run_shaped_phase(phase: Phase) -> tuple[dict[str, float], int]:
    """Medians on shaped links, and how many of the launch's namespaces remain afterwards."""
    repeats, leftovers = run_shaped_repeats(phase)
    return {name: statistics.median(times) for name, times in repeats.items()}, leftovers


def run_model_phase(phase: Phase) -> dict[str, float]:
    """Medians on loopback under the interceptor's network model."""
    results = run_bench_ranks(run_patterns, phase.world, phase=asdict(phase), mode="model")
    return _merge(results)


def _error(got: float, want: float) -> float:
    return abs(got - want) / want


def run_network_bench(quick: bool) -> dict[str, Any]:
    """Every phase in both modes; the report with per-pattern rows and the summary."""
    rows: list[dict[str, Any]] = []
    leftovers = 0
    for phase in phases(quick):
        shaped, left = run_shaped_phase(phase)
        leftovers += left
        model = run_model_phase(phase)
        for name, predicted in predictions(phase).items():
            rows.append(
                {
                    "phase": phase.name,
                    "pattern": name,
                    "shaped_s": shaped[name],
                    "model_s": model[name],
                    "rate_s": predicted,
                    "shaped_vs_rate": _error(shaped[name], predicted),
                    "model_vs_shaped": _error(model[name], shaped[name]),
                    "rate_defined": name in RATE_DEFINED,
                    "model_checked": name != "tenant_target",
                }
            )
    return {"rows": rows, "summary": summarise(rows, leftovers)}


def summarise(rows: list[dict[str, Any]], leftovers: int) -> dict[str, Any]:
    """The four figures the issue targets (and the ratios that show preemption works)."""
    by = {row["pattern"]: row for row in rows}
    shaped = {name: row["shaped_s"] for name, row in by.items()}
    return {
        "shaped_rate_max_error": max(r["shaped_vs_rate"] for r in rows if r["rate_defined"]),
        "contention_ratio": shaped["small_alltoall_behind"] / shaped["small_alltoall_alone"],
        "model_vs_shaped_max_error": max(r["model_vs_shaped"] for r in rows if r["model_checked"]),
        "tenant_model_vs_shaped_error": by["tenant_target"]["model_vs_shaped"],
        "leftover_namespaces": leftovers,
        "rate_change_slowdown_target": shaped["rate_change_target"] / shaped["before_target"],
        "rate_change_slowdown_other": shaped["rate_change_other"] / shaped["before_other"],
        "tenant_slowdown_target": shaped["tenant_target"] / shaped["before_target"],
        "tenant_slowdown_other": shaped["tenant_other"] / shaped["before_other"],
    }


def run_network_benchmark(*, quick: bool, json_path: str = "") -> int:
    """``colossal-hetero bench network``: print the table, write JSON; 0 when it ran."""
    console = Console()
    started = time.perf_counter()
    console.print(f"[bold]bench network[/]: shaped links at {RATE_GBPS * 1e3:g} Mbit/s vs model")
    report: dict[str, Any] = {
        "benchmark": "network",
        "quick": quick,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "rate_gbps": RATE_GBPS,
        "phases": [asdict(phase) for phase in phases(quick)],
        **run_network_bench(quick),
    }
    report["wall_time_s"] = time.perf_counter() - started
    table = Table(title="bench network: median seconds per transfer")
    for column in ("pattern", "shaped", "model", "rate", "shaped/rate", "model/shaped"):
        table.add_column(column, justify="right")
    for row in report["rows"]:
        table.add_row(
            row["pattern"],
            f"{row['shaped_s']:.4f}",
            f"{row['model_s']:.4f}",
            f"{row['rate_s']:.4f}",
            f"{row['shaped_s'] / row['rate_s']:.2f}",
            f"{row['model_s'] / row['shaped_s']:.2f}",
        )
    console.print(table)
    console.print(" ".join(f"{k}={_show(v)}" for k, v in report["summary"].items()))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        console.print(f"wrote {json_path}")
    return 0


def _show(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
