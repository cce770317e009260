"""``bench tp2d``'s report: the run's measurements into the JSON summary and a table (pure,
apart from ``run_tp2d_benchmark``, which spawns the ranks)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

from colossal_hetero.bench.tp2d import UNSLOWED, VARIANTS, Tp2dCase
from colossal_hetero.planner.tp2d_memory import Mode, gpt2_activation_bytes

MIB = 2**20
MODEL_MODES: tuple[tuple[str, Mode], ...] = (("1d", "1d"), ("1d_sp", "1d-sp"), ("2d", "2d"))


def quick_case() -> Tp2dCase:
    """The ``--quick`` case: rounds for at most 100 s."""
    return Tp2dCase(budget_s=100.0)


def full_case() -> Tp2dCase:
    """The full case: 3 warm-up rounds, up to 300 s of rounds."""
    return Tp2dCase(warmup=3, budget_s=300.0)


def predicted_bytes(case: Tp2dCase) -> dict[str, float]:
    """The planner's activation bytes per rank for the benchmark's model, per variant."""
    return {
        variant: gpt2_activation_bytes(
            mode,
            layers=case.layers,
            batch=case.batch_size,
            seq=case.seq_len,
            hidden=case.hidden,
            heads=case.heads,
            vocab=case.vocab,
            tp=case.world,
            elem_bytes=4,
        )
        for variant, mode in MODEL_MODES
    }


def summary(case: Tp2dCase, result: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures from rank 0's result (every rank's numbers are the same).

    Activation ratios: the worst rank's bytes of each variant at the benchmark batch.
    ``max_batch_2d_over_1d``: the largest batches found under the same budget.
    ``resizable_vs_even_2d``: median per-round step-time ratio, even over resized, one device
    at half speed; ``zero_resize_vs_even_2d`` the same for the slow rank ZERO-resized inside
    the SUMMA steps (even blocks). ``cost_model_bytes_max_error``: the largest relative error of the
    planner's activation bytes against the measured ones over the three unslowed variants.
    """
    memory, figures = result["memory"], result["rounds"]["figures"]
    act = {name: memory[name]["activation_bytes"] for name in UNSLOWED}
    predicted = predicted_bytes(case)
    errors = {name: abs(predicted[name] - act[name]) / act[name] for name in UNSLOWED}
    out: dict[str, Any] = {
        "activation_bytes_2d_over_1d": act["2d"] / act["1d"],
        "activation_bytes_2d_over_1d_sp": act["2d"] / act["1d_sp"],
        "max_batch_2d_over_1d": memory["2d"]["max_batch"] / memory["1d"]["max_batch"],
        "max_batch_2d_over_1d_sp": memory["2d"]["max_batch"] / memory["1d_sp"]["max_batch"],
        "resizable_vs_even_2d": figures["resizable_vs_even_2d"]["value"],
        "resizable_vs_even_2d_ci": figures["resizable_vs_even_2d"]["ci"],
        "resizable_predicted": result["resized_plan"]["predicted_speedup"],
        "cost_model_bytes_max_error": max(errors.values()),
        "cost_model_bytes_error": errors,
        "cost_model_bytes": predicted,
    }
    for key in ("step_1d_over_2d", "step_1d_sp_over_2d", "zero_resize_vs_even_2d"):
        if key not in figures:  # a result from before the ZERO-resized variant
            continue
        out[key] = figures[key]["value"]
        out[f"{key}_ci"] = figures[key]["ci"]
    out["converged"] = result["rounds"]["converged"]
    out["max_half_width"] = result["rounds"]["max_half_width"]
    return out


def variant_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant: memory (unslowed only), median step, bytes sent, calls, loss."""
    medians, memory = result["rounds"]["medians"], result["memory"]
    rows = []
    for name in VARIANTS:
        row: dict[str, Any] = {"variant": name}
        if name in memory:
            row.update(
                activation_bytes=memory[name]["activation_bytes"],
                state_bytes=memory[name]["state_bytes"],
                max_batch=memory[name]["max_batch"],
            )
        for key in ("step", "sent_bytes", "calls", "loss"):
            row[key] = medians[f"{name}.{key}"]["value"]
        row["step_ci"] = medians[f"{name}.step"]["ci"]
        rows.append(row)
    return rows


def run_tp2d_benchmark(*, quick: bool, json_path: str = "") -> int:
    """Spawn 4 ranks, measure, print the table, write the JSON (when ``json_path``)."""
    from rich.console import Console

    from colossal_hetero.bench.spawn import spawn_ranks
    from colossal_hetero.bench.tp2d import run_case

    case = quick_case() if quick else full_case()
    console = Console()
    console.print(
        f"[bold]tp2d[/]: GPT-2 {case.layers} layers, hidden {case.hidden}, {case.heads} heads, "
        f"batch {case.batch_size} x {case.seq_len}, tp 4; rounds budget {case.budget_s:.0f} s"
    )
    started = time.perf_counter()
    result = spawn_ranks(run_case, case.world, case=case)[0]
    report: dict[str, Any] = {
        "benchmark": "tp2d",
        "quick": quick,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "case": {k: getattr(case, k) for k in case.__dataclass_fields__},
        "summary": summary(case, result),
        "variants": variant_rows(result),
        "resized_plan": result["resized_plan"],
        "zero_resize": result.get("zero_resize"),
        "memory": result["memory"],
        "rounds": result["rounds"],
        "wall_time_s": time.perf_counter() - started,
    }
    _print(console, report)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        console.print(f"wrote {json_path}")
    return 0


def _print(console: Any, report: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="bench tp2d: per rank, medians over rounds with 95% intervals")
    for column in ("variant", "act MiB", "state MiB", "max batch", "step s", "sent MiB", "calls"):
        table.add_column(column, justify="right")
    for row in report["variants"]:
        mem = "activation_bytes" in row
        table.add_row(
            row["variant"],
            f"{row['activation_bytes'] / MIB:.2f}" if mem else "",
            f"{row['state_bytes'] / MIB:.2f}" if mem else "",
            str(row["max_batch"]) if mem else "",
            f"{row['step']:.3f} [{row['step_ci'][0]:.3f}, {row['step_ci'][1]:.3f}]",
            f"{row['sent_bytes'] / MIB:.1f}",
            f"{row['calls']:.0f}",
        )
    console.print(table)
    s = report["summary"]
    console.print(
        f"activation 2d/1d {s['activation_bytes_2d_over_1d']:.3f}, 2d/1d-sp "
        f"{s['activation_bytes_2d_over_1d_sp']:.3f}; max batch 2d/1d "
        f"{s['max_batch_2d_over_1d']:.2f}; resizable vs even 2d {s['resizable_vs_even_2d']:.2f}x "
        f"[{s['resizable_vs_even_2d_ci'][0]:.2f}, {s['resizable_vs_even_2d_ci'][1]:.2f}] "
        f"(predicted {s['resizable_predicted']:.2f}x); cost model bytes max error "
        f"{s['cost_model_bytes_max_error']:.3f}; total {report['wall_time_s']:.0f} s"
    )
