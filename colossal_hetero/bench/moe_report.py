"""``bench moe``'s report: the summary keys of the issue from one rank's result, the EP=4
section's figures, and the timeline picture of each variant's median step."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from colossal_hetero.bench.moe import (
    EP4,
    HF,
    PIPELINE,
    PIPELINE_MOST,
    RATE_MBIT,
    VARIANTS,
    WARMUP,
)

_NOT_BUILT = {
    "all_on_vs_deepspeed_moe": "DeepSpeed-MoE baseline not run (optional extra, not installed)",
    "speed_aware_vs_even_placement": "runtime re-placement and the heterogeneous case not built",
}
TITLES = {
    "ours_off": "priority off (plain bucketed overlap)",
    "ours_hold": "priority on, chunks held from dispatch to combine",
    "ours_on": "priority on, chunks fitted into the gaps between a2a's",
    "ours_pipe": f"fitted chunks and a2a/expert pipelining forced to {PIPELINE} ranges",
    "ours_pack": "fitted chunks and expert packing",
    "ours_all": "all on: held chunks, pipelining as its cost model chooses",
    "ours_s7": "all on as in session 7 (one step after the flush, counts a2a)",
    "ours_all_ep4": f"all on at EP={EP4}",
}


def _figure(figures: Mapping[str, Any], name: str) -> float | None:
    """A paired figure's value, None when its variants did not run (``--quick`` skips some)."""
    return float(figures[name]["value"]) if name in figures else None


def _ran(medians: Mapping[str, Any], series: str) -> list[str]:
    """The variants of ours at EP=2 x DP=2 with a median of ``series`` (those that ran)."""
    return [name for name in VARIANTS if f"{name}.{series}" in medians]


def ep4_summary(result: dict) -> dict[str, Any]:
    """The EP=4 section (``ep4``): ours all on against the stock plugin (and DeepSpeed-MoE
    when installed) with EP=4 on the same 4 ranks, paired per round; empty if it did not run."""
    figures, medians = result["rounds"]["figures"], result["rounds"]["medians"]
    if "ep4_all_vs_stock" not in figures:
        return {}
    section: dict[str, Any] = {
        "layout": f"EP={EP4} (one expert per rank, no expert replicas), dense DP=4",
        "all_on_vs_colossalai_moe": float(figures["ep4_all_vs_stock"]["value"]),
        "all_on_vs_colossalai_moe_ci": figures["ep4_all_vs_stock"]["ci"],
        "step_s": {
            name: float(medians[f"{name}.step"]["value"])
            for name in ("stock_ep4", "ours_all_ep4", "deepspeed_ep4")
            if f"{name}.step" in medians
        },
        "pipelining": result.get("pipelining_ep4"),
    }
    if "ep4_all_vs_deepspeed" in figures:
        section["all_on_vs_deepspeed_moe"] = float(figures["ep4_all_vs_deepspeed"]["value"])
        section["all_on_vs_deepspeed_moe_ci"] = figures["ep4_all_vs_deepspeed"]["ci"]
    return {"ep4": section}


ALL_ON_MEANS = (
    "priority on, chunks held from dispatch to combine (no gap fitting), a2a/expert pipelining "
    f"over 1 to {PIPELINE_MOST} token ranges as its cost model chooses, routing counts inside "
    "the dispatch a2a, the expert optimizer step during the dense gradient transfer "
    "(all_on_vs_session7_all_on: against all on without the last two); with one range "
    "(no pipelining), the exchange as one node computing a rank's own rows while the "
    "a2a's travel and the weight gradients during the dispatch's reverse (as every variant of "
    "ours without packing or pipelining: moe/exchange.py); expert packing apart "
    "(packing_on_vs_priority_on: it does not combine with pipelining and runs level with "
    "priority on); placement: even on equal devices, speed-aware in the heterogeneous case; "
    f"pipelining_on_vs_off: forced to {PIPELINE} ranges"
)
"""What ``ours_all`` runs, as the JSON's summary says it."""


def summarise(result: dict, network_mode: str, stretch: str = "dedicated") -> dict[str, Any]:
    """The issue's summary keys from one rank's result (all ranks agree)."""
    from colossal_hetero.bench.moe_devices import boundary_summary, describe

    medians = result["rounds"]["medians"]
    figures = result["rounds"]["figures"]

    def med(key: str) -> float:
        return float(medians[key]["value"])

    summary: dict[str, Any] = {
        "network_mode": network_mode,
        "emulation": describe(stretch),
        "link_rate_mbit": RATE_MBIT[stretch],
        "precision": "bf16",
        "stock_comm_fraction": med("stock.transfer") / med("stock.step"),
        "stock_comm_fraction_with_waits": med("stock.comm") / med("stock.step"),
        "all_on_vs_colossalai_moe": float(figures["ours_all_vs_stock"]["value"]),
        "priority_on_vs_colossalai_moe": float(figures["ours_on_vs_stock"]["value"]),
        "pipelining_on_vs_off": float(figures["pipe_vs_on"]["value"]),
        "all_on_vs_priority_on": float(figures["all_vs_on"]["value"]),
        "all_on_vs_hold": _figure(figures, "all_vs_hold"),
        "priority_off_vs_colossalai_moe": float(figures["ours_off_vs_stock"]["value"]),
        "priority_on_vs_off": float(figures["on_vs_off"]["value"]),
        "fit_vs_hold": float(figures["on_vs_hold"]["value"]),
        "all_on_vs_session7_all_on": _figure(figures, "all_vs_s7"),
        "a2a_under_allreduce_over_alone": med("ours_on.a2a_under") / med("ours_on.a2a_alone"),
        "a2a_under_allreduce_over_alone_priority_off": med("ours_off.a2a_under")
        / med("ours_off.a2a_alone"),
        "a2a_under_allreduce_over_alone_hold": med("ours_hold.a2a_under")
        / med("ours_hold.a2a_alone"),
        "a2a_with_chunks_on_wire": {
            n: med(f"{n}.a2a_overlapped") for n in _ran(medians, "a2a_overlapped")
        },
        "max_loss_diff_vs_stock": result["max_loss_diff_vs_stock"],
        "all_on_means": ALL_ON_MEANS,
        "packing_on_vs_priority_on": float(figures["pack_vs_on"]["value"]),
        "a2a_bytes_per_step": {n: med(f"{n}.a2a_bytes") for n in _ran(medians, "a2a_bytes")},
        "packing_a2a_bytes_saved": 1 - med("ours_pack.a2a_bytes") / med("ours_on.a2a_bytes"),
        "packing_remote_bytes": result.get("packing"),
        **_pipelining_summary(result.get("pipelining"), med),
        "collectives_outside_interceptor": boundary_summary(result["rounds"].get("series", {})),
        **ep4_summary(result),
    }
    for key, reason in _NOT_BUILT.items():
        summary[key] = None
        summary[f"{key}_reason"] = reason
    if "all_on_vs_deepspeed" in figures:  # H6's baseline ran (bench/moe_deepspeed.py)
        summary["all_on_vs_deepspeed_moe"] = float(figures["all_on_vs_deepspeed"]["value"])
        summary.pop("all_on_vs_deepspeed_moe_reason")
    elif "reason" in result.get("deepspeed", {}):
        summary["all_on_vs_deepspeed_moe_reason"] = result["deepspeed"]["reason"]
    return summary


def _pipelining_summary(record: dict | None, med: Callable[[str], float]) -> dict[str, Any]:
    """The all-on variant's pipelining choice, and the cost model's predicted step change of
    the forced ``PIPELINE`` ranges over one against the measured one (ours_pipe - ours_on)."""
    if not record:
        return {"pipelining_ranges_chosen": None}
    predicted = {int(n): float(t) for n, t in record["predicted_s"].items()}
    layers = HF["num_hidden_layers"]
    decided = record.get("decided_at")
    return {
        "pipelining_ranges_chosen": record["ranges"],
        "pipelining_trial": record.get("trial"),  # absent: one range chosen, nothing tried
        # the warm-up covers the choice and its trial: no measured step ran a dropped setting
        "pipelining_decided_in_warmup": None if decided is None else decided < WARMUP,
        "pipelining_step_delta_ms": {
            "measured": 1e3 * (med("ours_pipe.step") - med("ours_on.step")),
            "predicted": 1e3 * layers * (predicted[PIPELINE] - predicted[1]),
        },
    }


def write_report(report: dict[str, Any], timelines: dict[str, list], json_path: str) -> None:
    """Write ``report`` to ``json_path`` with the timeline PNG of ``timelines`` (each
    variant's median step log) beside it."""
    from colossal_hetero.moe.timeline import plot_timelines

    png = Path(json_path).with_suffix(".timeline.png")
    plot_timelines({TITLES.get(k, k): v for k, v in timelines.items()}, png)
    report["timeline_png"] = str(png)
    Path(json_path).write_text(json.dumps(report, indent=1))
