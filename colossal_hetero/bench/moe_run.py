"""``colossal-hetero bench moe``'s driver: launch the ranks (``bench/moe.py``'s worker), the
heterogeneous case (``bench/moe_hetero.py``), then the summary, JSON and plots
(``bench/moe_report.py``). Apart from ``bench/moe.py`` so that the report, which reads that
module's constants, and the driver, which calls the report, import one way.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from colossal_hetero.bench.moe import (
    EP,
    EP4,
    HF,
    PER_RANK,
    RATE_MBIT,
    SEQ,
    moe_worker,
)
from colossal_hetero.bench.moe_devices import device_emulation
from colossal_hetero.bench.moe_hetero import run_hetero_case
from colossal_hetero.bench.moe_prime import DESCRIPTION as PRIMING
from colossal_hetero.bench.moe_report import summarise, write_report
from colossal_hetero.bench.shaped_spawn import run_bench_ranks
from colossal_hetero.config.schema import NetworkEmulationConfig


def run_moe_benchmark(
    *, quick: bool, json_path: str = "", network: str = "shaped", stretch: str = "dedicated"
) -> int:
    """Run the benchmark on 4 ranks; print the summary; write JSON to ``json_path``.
    ``stretch``: ``dedicated`` (every rank on an emulated device of its own) or ``none``
    (bench/moe_devices.py)."""
    started, load_before = time.perf_counter(), os.getloadavg()
    device_emulation(4, stretch)  # a bad stretch fails here, before any rank starts
    links = NetworkEmulationConfig(mode="shaped", bandwidth_gbps=RATE_MBIT[stretch] / 1000)
    shaped = links if network == "shaped" else None
    results = run_bench_ranks(moe_worker, 4, network=shaped, quick=quick, stretch=stretch)
    if json_path:  # the raw per-rank results first: a failing summary keeps the run
        Path(json_path).with_suffix(".raw.json").write_text(json.dumps(results[0]))
    summary = summarise(results[0], network, stretch)
    hetero = run_hetero_case(quick=quick)  # H6's heterogeneous case (bench/moe_hetero.py)
    summary["speed_aware_vs_even_placement"] = hetero["speed_aware_vs_even_placement"]
    summary.pop("speed_aware_vs_even_placement_reason", None)
    summary["priming"] = PRIMING  # bench/moe_prime.py
    report = {
        "benchmark": "moe",
        "quick": quick,
        "world_size": 4,
        "layout": f"EP={EP} x DP=2 (section ep4: EP={EP4})",
        "model": HF,
        "seq_len": SEQ,
        "per_rank_batch": PER_RANK,
        "link_rate_mbit": RATE_MBIT[stretch] if network == "shaped" else None,
        "wall_s": time.perf_counter() - started,
        "host_load_average": {"before": load_before, "after": os.getloadavg()},
        "summary": summary,
        "chunking": results[0]["chunking"],
        "rounds": results[0]["rounds"],
        "twin_leads": results[0]["twin_leads"],  # bench/moe_order.py
        "priming": results[0]["priming"],  # bench/moe_prime.py
        "pipelining": {"ep2": results[0]["pipelining"], "ep4": results[0]["pipelining_ep4"]},
        "deepspeed": results[0]["deepspeed"],
        "heterogeneous": hetero,
    }
    print(json.dumps(summary, indent=1))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
        write_report(report, results[0]["timelines"], json_path)
    return 0
