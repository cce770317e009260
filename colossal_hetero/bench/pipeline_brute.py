"""Every near stage split of ``bench pipeline``'s phase (c), measured: is the planned one best?

``python -m colossal_hetero.bench.pipeline_brute OUT.json [ROUNDS]`` (run it under the bench
lock: it is a benchmark; about 2 minutes). One launch of PP=2 x TP=2 on the bench's shaped
links without preemption, every rank at phase (c)'s speeds (``pipeline_stretch.Stretch``,
``dedicated``, the spec's base and slow rank). Colossal-AI's 1F1B runs on the splits
``PLANNED_WIDTH_SPLITS`` with the planned TP widths (the ``planned_1f1b`` variant's config with
``parallel.num_layers_per_stage`` set), on ``EVEN_WIDTH_SPLITS`` with even widths
(``cluster.devices`` equal: the planner keeps widths even), and ``stock`` (HybridParallelPlugin,
even split and widths) for the ratios: ``ROUNDS`` rounds (4), each running every candidate once
in an order rotated by the round, each step counted at the slowest rank. The JSON holds every
step, each candidate's median and its median per-round ratio of ``stock`` over it (the bench's
``planned_vs_even_split_slow_stage`` for that split), each rank's TP widths, and the load.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import torch

PLANNED_WIDTH_SPLITS = ([2, 10], [3, 9], [4, 8], [5, 7], [6, 6])
"""PP=2 x TP=2's splits run with the planned widths: stage 0 (the slowed device's) holds 2-6
of the 12 blocks ([1, 11] and [7, 5] onwards: predicted > 30% behind the best)."""
EVEN_WIDTH_SPLITS = ([3, 9], [4, 8], [5, 7])
"""The splits run with even widths too: those next to the bench's pick."""


def summarise_steps(steps: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per candidate: median step seconds, and the median per-round ratio of ``stock``'s step
    over its own (> 1: faster than stock)."""
    stock = steps["stock"]
    return {
        name: {
            "median_s": statistics.median(values),
            "stock_over": statistics.median(a / b for a, b in zip(stock, values, strict=True)),
        }
        for name, values in steps.items()
    }


def _candidates(spec: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Name -> plugin config: stock, the planned-width splits, the even-width ones."""
    from colossal_hetero.bench.pipeline_model import build_configs

    model_cfg, equal = build_configs(spec, "equal", device)
    out: dict[str, Any] = {"stock": equal["stock"]}
    even_devices = {**spec, "slow_factor": 1.0}  # equal speeds: the planner keeps widths even
    for kind, splits, devices in (
        ("planned_widths", PLANNED_WIDTH_SPLITS, spec),
        ("even_widths", EVEN_WIDTH_SPLITS, even_devices),
    ):
        for split in splits:
            configs = build_configs(devices, "slow", device, layers=list(split))[1]
            out[f"{kind} {list(split)}"] = configs["planned_1f1b"]
    return {"model": model_cfg, "configs": out}


def brute_worker(
    *, rank: int, world_size: int, device: torch.device, spec: dict[str, Any], rounds: int
) -> dict[str, Any]:
    """Every candidate on this rank, ``rounds`` rotated rounds; rank-identical results."""
    import torch.distributed as dist

    from colossal_hetero.bench.pipeline_model import DEVICE_BASE
    from colossal_hetero.bench.pipeline_runner import (
        Runner,
        build_plugins,
        gather_rows,
        workload_of,
    )
    from colossal_hetero.bench.pipeline_stretch import Stretch
    from colossal_hetero.plugin import prepare_device

    prepare_device(device)
    factor = spec["slow_factor"] if rank in spec["slow_ranks"] else 1.0
    base = spec.get("device_base", DEVICE_BASE)
    stretch = Stretch(factor, mode="dedicated", base=base, median_work=True)
    built = _candidates(spec, device)
    plugins = build_plugins(built["configs"], device, workload_of(spec))
    runners = {name: Runner(name, p, built["model"], spec) for name, p in plugins.items()}
    for runner in runners.values():
        runner.step(seed=10**6)  # lazy initialisation, unstretched
        stretch.attach(runner.blocks)
        runner.stretch = stretch
    names = list(runners)
    steps: dict[str, list[float]] = {name: [] for name in names}
    stretch.enabled = True
    for i in range(rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            rows = gather_rows([runners[name].step(seed=i)[0]])
            steps[name].append(max(row[0] for row in rows))
    stretch.enabled = False
    widths = {
        n: {k: list(v) for k, v in r.plugin.stage_widths.items()}
        for n, r in runners.items()
        if hasattr(r.plugin, "stage_widths")
    }
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, widths)
    for runner in runners.values():
        close = getattr(runner.plugin, "close", None)
        if close is not None:
            close()
    return {"steps": steps, "widths_by_rank": every}


def main(argv: list[str]) -> int:
    """Run the experiment; print each candidate's median and ratio; write the JSON."""
    from colossal_hetero.bench.pipeline import build_specs
    from colossal_hetero.bench.pipeline_model import network_config
    from colossal_hetero.bench.shaped_spawn import run_bench_ranks

    if not argv or len(argv) > 2:
        print(__doc__)
        return 2
    rounds = int(argv[1]) if len(argv) > 1 else 4
    layout = "pp2xtp2"
    spec = next(s for s in build_specs(True, "shaped") if s.name == layout).to_dict()
    network = replace(network_config(spec, "shaped"), preemptions=[])
    load = os.getloadavg()[0]
    started = time.perf_counter()
    # By its module's name: run as ``-m``, this module is ``__main__``, which the shaped
    # ranks cannot import.
    from colossal_hetero.bench.pipeline_brute import brute_worker as worker

    result = run_bench_ranks(worker, 4, network=network, spec=spec, rounds=rounds)[0]
    result.update(
        layout=layout,
        rounds=rounds,
        wall_s=time.perf_counter() - started,
        load_average_1m={"start": load, "end": os.getloadavg()[0]},
        summary=summarise_steps(result["steps"]),
    )
    with open(argv[0], "w") as out:
        json.dump(result, out, indent=1)
    for name, row in result["summary"].items():
        print(f"{name:24s} {row['median_s']:.3f} s   stock / this {row['stock_over']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
