"""Benchmarks: ``colossal-hetero bench NAME [--quick] [--json PATH]``.

Each compares against stock Colossal-AI in the same run (``network`` compares shaped links
with the network model) and reports medians and ratios with 95% confidence intervals, measured
in interleaved rounds (``bench.rounds``). Each benchmark's module is imported only when it runs.
"""

from __future__ import annotations

from typing import Literal

BENCHMARKS = ("static", "network", "pipeline", "dynamic", "moe", "tp2d", "kernels")
"""The names ``colossal-hetero bench`` takes."""

NETWORK_CHOICE = ("static", "pipeline")
"""The benchmarks whose links ``--network`` picks (static's default: the model; pipeline's:
shaped links, falling back to the model where they cannot be built)."""


def run_benchmark(
    name: str,
    *,
    quick: bool,
    json_path: str = "",
    only: str = "",
    network: Literal["model", "shaped"] | None = None,
) -> int:
    """Run benchmark ``name``; print its table; write its JSON to ``json_path`` when given.

    ``only`` selects cases (static) or parts and modes (dynamic); ``network`` picks the links
    of the benchmarks in :data:`NETWORK_CHOICE` (None: each one's default; the MoE and network
    benchmarks run on shaped links themselves, falling back to the model where shaping is
    unavailable). Raises ConfigError for ``network`` given to another benchmark.
    """
    if network is not None and name not in NETWORK_CHOICE:
        from colossal_hetero.config import ConfigError

        raise ConfigError(
            f"--network: bench {name} picks its own links; only "
            f"{' and '.join(NETWORK_CHOICE)} take --network"
        )
    if name == "static":
        from colossal_hetero.bench.static_driver import run_static_benchmark

        return run_static_benchmark(
            quick=quick, json_path=json_path, only=only, network=network or "model"
        )
    if name == "network":  # shaped links against the network model (no stock baseline)
        from colossal_hetero.bench.network import run_network_benchmark

        return run_network_benchmark(quick=quick, json_path=json_path)
    if name == "pipeline":  # kFkB / Ada-Grouper vs Colossal-AI's 1F1B on shaped links
        from colossal_hetero.bench.pipeline import run_pipeline_benchmark

        return run_pipeline_benchmark(quick=quick, json_path=json_path, network=network)
    if name == "dynamic":  # runtime balancer modes vs stock TP under a straggler schedule
        from colossal_hetero.bench.dynamic import run_dynamic_benchmark

        return run_dynamic_benchmark(quick=quick, json_path=json_path, only=only)
    if name == "moe":  # Mixtral EP=2 x DP=2: stock MoE plugin vs ours, priority off/on
        from colossal_hetero.bench.moe_run import run_moe_benchmark

        return run_moe_benchmark(quick=quick, json_path=json_path)
    if name == "tp2d":  # 2D (SUMMA) vs stock 1D TP and 1D + sequence parallelism
        from colossal_hetero.bench.tp2d_report import run_tp2d_benchmark

        return run_tp2d_benchmark(quick=quick, json_path=json_path)
    if name == "kernels":  # one device: GEMM time vs shard width, ZERO-resizing's saving
        from colossal_hetero.bench.kernels import run_kernels_benchmark

        return run_kernels_benchmark(quick=quick, json_path=json_path)
    raise ValueError(f"bench: unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
