"""Micro-benchmarks of this rank's compute speed and the links between ranks.

They run under whatever emulation is installed, so a rank emulated 2x slower measures half
the FLOP/s: that is the speed the planner should see.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from colossal_hetero.utils.device import synchronize

# The micro-benchmarks live in utils/probe.py (the plugin calibrates with them too).
from colossal_hetero.utils.probe import agree, measure_allreduce_gbps, measure_flops

__all__ = [
    "agree",
    "calibrate_model",
    "cluster_yaml",
    "measure_allreduce_gbps",
    "measure_flops",
    "profile_rank",
    "profile_ranks",
]


def profile_rank(
    rank: int, world_size: int, device: torch.device, emulation: Any, run: Any = None
) -> dict:
    """Spawned on every rank: measure under ``emulation`` (an EmulationConfig or None).

    FLOP/s come from the interceptor's compute time (time outside collectives, emulated
    stretch included), so waiting for slower peers does not count against a fast rank. With a
    ``run`` config, also calibrate its model (FLOP/s and fixed per-layer time, unemulated).
    """
    from colossal_hetero.config.schema import EmulationConfig
    from colossal_hetero.emulation import build_interceptor
    from colossal_hetero.plugin import prepare_device

    prepare_device(device)
    size, repeats = 384, 7
    with build_interceptor(emulation or EmulationConfig(), rank, world_size, device) as timer:
        timer.begin_step(0)
        measure_flops(device, size=size, repeats=repeats)
        timing = timer.end_step()
        with timer.step(1):  # emulation acts inside steps only: links are modelled here too
            gbps = measure_allreduce_gbps(device)
    result = {"flops": repeats * 2 * size**3 / timing.compute_time, "gbps": gbps}
    if run is not None:
        result["model_flops"], result["layer_overhead_s"] = calibrate_model(
            run.model, run.data.global_batch_size, run.data.seq_len, device
        )
    return result


def profile_ranks(nproc: int, emulation: Any, run: Any = None) -> list[dict]:
    """``profile_rank`` on ``nproc`` local ranks: on real shaped links when the emulation's
    network is ``mode: shaped`` (``bench.shaped_spawn``; CPU ranks, so a run configured for a
    GPU ``cluster.device`` is refused), else spawned on loopback under the emulation's model."""
    from colossal_hetero.bench.shaped_spawn import run_bench_ranks, wants_shaped

    network = emulation.network if emulation is not None else None
    if wants_shaped(network) and run is not None:
        from colossal_hetero.emulation.shaped.launcher import check_shaped_device

        check_shaped_device(run.cluster.device)
    return run_bench_ranks(profile_rank, nproc, network=network, emulation=emulation, run=run)


def cluster_yaml(results: list[dict], device_kind: str) -> dict:
    """A ``cluster`` + ``plan`` YAML fragment from per-rank measurements.

    Speeds are relative to the fastest rank's matmul rate; the reference FLOP/s and per-layer
    overhead come from the model calibration when there is one.
    """
    fastest = max(r["flops"] for r in results)
    plan: dict[str, float] = {"reference_tflops": fastest / 1e12}
    if "model_flops" in results[0]:
        plan = {
            "reference_tflops": max(r["model_flops"] for r in results) / 1e12,
            "layer_overhead_us": min(r["layer_overhead_s"] for r in results) * 1e6,
        }
    return {
        "cluster": {
            "device": device_kind,
            "devices": [
                {"speed": round(r["flops"] / fastest, 4), "bandwidth_gbps": round(r["gbps"], 3)}
                for r in results
            ],
        },
        "plan": plan,
    }


def _tiny(model_cfg: Any) -> Any:
    """The same model with one feature per head: its step is almost all fixed per-op cost."""
    import dataclasses

    from colossal_hetero.models import build_hf_config

    heads = build_hf_config(model_cfg).num_attention_heads
    shrink = {
        "gpt2": {"n_embd": heads},
        "llama": {"hidden_size": heads, "intermediate_size": 4 * heads},
        "bert": {"hidden_size": heads, "intermediate_size": 4 * heads},
        "vit": {"hidden_size": heads, "intermediate_size": 4 * heads},
    }[model_cfg.arch]
    return dataclasses.replace(model_cfg, hf={**model_cfg.hf, **shrink})


def _step_seconds(model_cfg: Any, batch_size: int, seq_len: int, device: torch.device) -> float:
    from colossal_hetero.bench.measure import text_batch
    from colossal_hetero.models import build_model

    model = build_model(model_cfg).to(device)
    batch = {k: v.to(device) for k, v in text_batch(batch_size, seq_len, 0).items()}
    times = []
    for _ in range(6):
        synchronize(device)
        start = time.perf_counter()
        model(**batch).loss.backward()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def calibrate_model(
    model_cfg: Any, batch_size: int, seq_len: int, device: torch.device
) -> tuple[float, float]:
    """(FLOP/s, fixed seconds per layer) that make the planner's cost model match this device.

    Times a single-process training step of the model and of the model shrunk to one feature
    per head (its fixed per-op cost); the difference is the width-proportional work, whose
    FLOPs the planner's model spec counts. No collectives: call it outside emulation.
    """
    from colossal_hetero.models import build_hf_config
    from colossal_hetero.planner.cost import BACKWARD_FLOPS_FACTOR
    from colossal_hetero.planner.hf import model_spec_from_hf

    full = _step_seconds(model_cfg, batch_size, seq_len, device)
    fixed = _step_seconds(_tiny(model_cfg), batch_size, seq_len, device)
    spec = model_spec_from_hf(build_hf_config(model_cfg), batch_size, seq_len)
    flops = sum(
        batch_size * layer.flops_per_token * layer.tokens * (1.0 + BACKWARD_FLOPS_FACTOR)
        for layer in spec.layers
    )
    return flops / max(full - fixed, 1e-9), fixed / len(spec.layers)
