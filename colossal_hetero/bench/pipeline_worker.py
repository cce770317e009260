"""Rank side of ``colossal-hetero bench pipeline``: build the variants, run the three phases.

Started on every rank by ``bench.shaped_spawn.run_bench_ranks`` (shaped links) or spawned on
loopback (model mode), as ``run_pipeline_worker(rank=, world_size=, device=, spec=)`` where
``spec`` is :meth:`bench.pipeline.BenchSpec.to_dict`. One process per rank holds every variant
side by side (each its own plugin, process groups and model copy); the rounds helper steps
them in rotating order, so every round's variants share the machine load and the network
state. Rounds are numbered globally across the phases; each round's first step reports that
number to the shaped launcher's preemption controller (tenant traffic on or off) and, when
that turns the tenant on or off, waits ``settle_s`` for it to take effect.

Variants (names used in the JSON):

- ``stock``: Colossal-AI's HybridParallelPlugin, its 1F1B, even split;
- ``planned_1f1b``: HeteroParallelPlugin, Colossal-AI's 1F1B on the planned split;
- ``k{n}``: HeteroParallelPlugin, ``KFKBSchedule`` with a fixed ``k = n``, planned split;
- ``ada``: HeteroParallelPlugin ``ada_kfkb``, planned split, under the memory budget;
- ``ada_link_shares`` (phases a and b of full runs with TP only,
  ``BenchSpec.link_shares_variant``): ``ada`` with ``parallel.pp_link_shares: true``, so the
  link shares' own gain is measured in the same rounds;
- ``k1_even`` (phase c of full runs only): the equal set's ``k1`` (``KFKBSchedule``,
  ``k = 1``, even split and widths), the even split under our executor.

Every rank of every phase computes on an emulated device of its own (``bench.pipeline_stretch``,
``dedicated``: ``free_base`` times slower than a core in (a) and (b), ``device_base`` in (c)).
Phases (a) and (b) share one set (equal speeds: the planned split is the planner's for equal
stages); phase (c) slows one device to half speed and uses a second
set planned for that: told the devices' speeds, so each stage's TP widths are planned, and
the stage times ``measure_stage_times`` takes (``plan.stage_times``), so the plugin plans the
split; ``try_splits`` then runs the user's trial (``pipeline.split_trial``) of that split
against its near ties (``stock`` is shared: its even split and widths ignore speeds). The first
free round after a tenant stretch waits ``drain_s`` more (``Phases.drain_s``).

Each step returns the slowest rank's seconds (``step``: execute_pipeline + optimizer step,
``pipe``: execute_pipeline alone), the ``k`` it ran, each stage's peak activation bytes
(measured: saved-tensor bytes per micro-batch times the micro-batches held at once), and for
kFkB-scheduled variants the simulator's prediction of ``pipe`` from that step's own per-stage
forward/backward times and message bytes at the round's link rate.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from colossal_hetero.bench.pipeline_model import (
    DEVICE_BASE,
    ROW,
    build_configs,
    phase_policy,
    stage_peaks,
)
from colossal_hetero.bench.pipeline_runner import (
    NO_ROUND,
    WARM_SEED,
    CollectorLog,
    Runner,
    build_plugins,
    freeze_built,
    gather_rows,
    workload_of,
)
from colossal_hetero.bench.pipeline_split import (
    first_probe_steps,
    measure_stage_times,
    probe_runner,
    refit_and_probe,
    stage_widths,
    stretch_by_rank,
    stretch_totals,
    trial_record,
    try_splits,
)
from colossal_hetero.bench.pipeline_stretch import Stretch
from colossal_hetero.bench.rounds import (
    Figure,
    RoundsPolicy,
    Variant,
    rank0_decides,
    run_rounds,
)
from colossal_hetero.bench.shaped_spawn import on_shaped_links, report_bench_step
from colossal_hetero.config.schema import HeteroConfig
from colossal_hetero.pipeline.tuner import stage_of_rank
from colossal_hetero.utils.device import collective_device
from colossal_hetero.utils.probe import probe_world


class Phases:
    """Global round numbering, tenant settling, and each variant as a rounds-helper variant."""

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        self.spec, self.rank = spec, rank
        self.layout = stage_of_rank(spec["pp"], spec["tp"], 1)
        self.offset = 0
        """Global number of the running phase's first round (its warm-up included)."""
        self.round = NO_ROUND
        """The round running now (model mode's links read their preemptions at it)."""
        self._reported = -1

    def _enter_round(self, index: int) -> tuple[int, bool]:
        """The round's global number, and whether this step is the first after a tenant
        stretch (its variant then runs one unrecorded step first: ``drain_s``)."""
        number = self.offset + index
        if number == self._reported:
            return number, False
        self.round = number
        report_bench_step(self.rank, number)  # the round's first step
        drain = self.drain_s(number)
        time.sleep(self.settle_s(number) + drain)
        dist.barrier()
        self._reported = number
        return number, drain > 0

    def settle_s(self, number: int) -> float:
        """The wait before round ``number`` for the tenant to start or stop: ``settle_s`` when
        the targeted link's share changes from the round before, else none (the rounds of
        phases a and c, and those inside a stretch, change nothing on the link). None on the
        model's links, whose trace acts at the round itself."""
        if self.spec["network_mode"] == "model":
            return 0.0
        shares = self.spec["shares"]
        changed = 0 < number < len(shares) and shares[number - 1] != shares[number]
        return float(self.spec["settle_s"]) if changed else 0.0

    def drain_s(self, number: int) -> float:
        """Extra wait before round ``number`` when it is the first free round after a tenant
        stretch: the link's queue still drains the tenant's bytes, and whichever variant ran
        first paid for it (PP=4, phase b: the variant first in that round 516-593 ms, 311 ms
        in the other free round), the same variant every run as the rotation is fixed. A wait
        alone left it ~1.3x its median against the others' (one run, load 14), so that
        variant also runs one unrecorded step on the link first. None on the model's links,
        which no tenant's bytes occupy."""
        if self.spec["network_mode"] == "model":
            return 0.0
        shares = self.spec["shares"]
        after = 0 < number < len(shares) and shares[number - 1] < 1.0 <= shares[number]
        return float(self.spec.get("drain_s", 0.0)) if after else 0.0

    def variant(self, runner: Runner) -> Variant:
        spec, layout = self.spec, self.layout
        runner.follow_rounds(lambda: self.round)

        def run(index: int, *, warmup: bool) -> dict[str, float] | None:
            number, drain = self._enter_round(index)
            if drain:  # unrecorded: what the tenant left on the link is paid here
                runner.step(seed=WARM_SEED)
            rows = gather_rows(runner.step(seed=number))
            if warmup:
                return None
            out = {
                "step": max(r[0] for r in rows),
                "pipe": max(r[1] for r in rows),
                "k": rows[0][ROW.index("k")],
            }
            for s, peak in enumerate(stage_peaks(rows, layout, spec["pp"])):
                out[f"mem{s}"] = peak
            out["stretch"] = max(r[ROW.index("stretch_s")] for r in rows)
            if runner.kfkb:
                out["sim"], out["meas"] = runner.prediction(int(out["k"]))
            return out

        return run


def _figures(variants: list[str]) -> dict[str, Figure]:
    """Per-round speedups of each variant over Colossal-AI's stock 1F1B (time ratios)."""

    def over_stock(name: str) -> Figure:
        return lambda v: v["stock.step"] / v[f"{name}.step"]

    return {f"{name}_vs_stock": over_stock(name) for name in variants if name != "stock"}


def _budget_from(runner: Runner, spec: dict[str, Any]) -> float:
    """MiB for ada: ``budget_microbatches`` times the largest measured micro-batch (all ranks)."""
    act = torch.tensor([float(runner.schedule.last_stats.activation_bytes)], dtype=torch.float64)
    dist.all_reduce(act, op=dist.ReduceOp.MAX)
    return spec["budget_microbatches"] * float(act.item()) / 2**20


def _build_set(
    spec: dict[str, Any], split: str, device: torch.device, shared: dict[str, Runner]
) -> dict[str, Runner]:
    """The variants of one split (those in ``shared`` as they are); ada last, with a budget from
    the k=1 variant's measurement."""
    model_cfg, configs = build_configs(spec, split, device)
    runners = dict(shared)
    adas = [name for name in configs if name.startswith("ada")]  # ada, ada_link_shares
    configs = {n: c for n, c in configs.items() if n not in shared and n not in adas}
    for name, plugin in build_plugins(configs, device, workload_of(spec)).items():
        runners[name] = Runner(name, plugin, model_cfg, spec)
        runners[name].step(seed=WARM_SEED)  # warm: lazy initialisation, first allocations
    budget = _budget_from(runners["k1"], spec)
    with_budget = build_configs(spec, split, device, ada_budget_mib=budget)[1]
    for name in sorted(adas, key=lambda n: n == "ada"):  # ada last
        assert isinstance(with_budget[name], HeteroConfig)
        plugin = build_plugins({name: with_budget[name]}, device, workload_of(spec))[name]
        runners[name] = Runner(name, plugin, model_cfg, spec)
        runners[name].step(seed=WARM_SEED)
        runners[name].budget_mib = budget  # type: ignore[attr-defined]
    return runners


def _rounds(phases: Phases, runners: dict[str, Runner], policy: RoundsPolicy) -> Any:
    variants = {name: phases.variant(r) for name, r in runners.items()}
    decide = rank0_decides(collective_device())
    return run_rounds(variants, _figures(list(runners)), policy, decide=decide)


def run_pipeline_worker(
    *, rank: int, world_size: int, device: torch.device, spec: dict[str, Any]
) -> dict[str, Any]:
    """Every phase on this rank; rank-identical results (from all-gathered rows).

    ``timings``: wall seconds of the set-up's parts (``build_equal_s``, ``probe_s``: the
    probe's build and its measured steps, ``trial_s``, ``build_slow_s``), ``collect_s`` (the
    garbage collection of every variant afterwards), ``entered_at`` and ``left_at``
    (``time.time()`` as the worker starts and returns: the launch before it and the exit after
    it are the driver's to time)."""
    from colossal_hetero.plugin import prepare_device

    timings: dict[str, float] = {"entered_at": time.time()}
    prepare_device(device)  # the gloo/CPU fixes Colossal-AI's stock plugin needs too
    collector = CollectorLog().install()
    try:
        out = _run_phases(rank, device, spec, timings)
    finally:
        collector.uninstall()
    out["collector_by_rank"] = collector.by_rank()
    # The variants (models, optimizers, hooks; reference cycles) are garbage now: collect them
    # here, timed, rather than in the exit path's collection (``close_process_group``).
    collected = time.perf_counter()
    gc.unfreeze()  # the variants were frozen as built (pipeline_runner.freeze_built)
    gc.collect()
    timings["collect_s"] = time.perf_counter() - collected
    out["timings"] = {**timings, "left_at": time.time()}
    if on_shaped_links():
        atexit.register(_exit_at_once)
    return out


def _run_phases(
    rank: int, device: torch.device, spec: dict[str, Any], timings: dict[str, float]
) -> dict[str, Any]:
    """Build the variants, run phases (a)-(c), close the plugins; the result without
    ``timings`` (its set-up parts are added to ``timings``)."""
    started = time.perf_counter()
    phases = Phases(spec, rank)
    equal = _build_set(spec, "equal", device, {})
    freeze_built()
    timings["build_equal_s"] = time.perf_counter() - started
    # Every phase runs every rank on an emulated device of its own (``dedicated``: no
    # neighbour's sleep speeds it up or its work slows it down), phase (c)'s slower and the
    # slow ranks' at half speed there (bench/pipeline_stretch.py). The equal set's build
    # steps ran before, at the core's speed (unrecorded).
    devices = _phase_devices(spec, rank)
    stretch = Stretch(1.0, mode="dedicated", median_work=True)
    for runner in equal.values():
        stretch.attach(runner.blocks)
        runner.stretch = stretch
    stretch.set_device(*devices["c"])
    slow, measured, extra = _slow_set(spec, device, equal, stretch, phases.layout, timings)
    freeze_built()
    out: dict[str, Any] = {"setup_s": time.perf_counter() - started, "phases": {}}
    out["measured_split"] = measured
    for name, runners in (("a", equal), ("b", equal), ("c", slow)):
        phase = spec["phases"][name]
        stretch.set_device(*devices[name])
        stretch.enabled = True
        phases.offset = phase["start"]
        # Rank 0's clock sets the stop (``rank0_decides``): the same rounds on every rank.
        before = stretch_totals(stretch)
        result = _rounds(phases, runners, phase_policy(spec, name, time.time()))
        out["phases"][name] = result.to_dict()
        # Each rank's device totals over the phase: compute_wall_s / cpu_s is the host's
        # contention, which the emulated devices absorb while it stays below their base.
        out["phases"][name]["stretch_by_rank"] = stretch_by_rank(before, stretch)
        out["phases"][name]["figure_series"] = result.figure_series
        out["phases"][name]["first_round"] = phase["start"] + phase["warmup"]
    out["ada"] = {
        split: {
            "budget_mib": runners["ada"].budget_mib,  # type: ignore[attr-defined]
            "decisions": _decisions(runners["ada"]),
        }
        for split, runners in (("equal", equal), ("slow", slow))
    }
    every = (*equal.values(), *slow.values(), *extra)
    for runner in {id(r): r for r in every}.values():
        runner.close()
    return out


def _phase_devices(spec: dict[str, Any], rank: int) -> dict[str, tuple[float, float]]:
    """Per phase, this rank's emulated device as ``Stretch.set_device``'s (factor, base)."""
    free = (1.0, spec.get("free_base", DEVICE_BASE))
    factor = spec["slow_factor"] if rank in spec["slow_ranks"] else 1.0
    return {"a": free, "b": free, "c": (factor, spec.get("device_base", DEVICE_BASE))}


def _exit_at_once() -> None:
    """A shaped rank's last exit handler (registered last, so run first): flush and leave.

    By then ``shaped_spawn.main`` has written this rank's result and closed its process group;
    what remains is the interpreter's teardown (a trivial rank's: 3.5-4.3 s at load 8-10 on
    the shared 2 cores). Exit code 0 either way: a rank that failed before writing its result
    still fails the run, as the driver then finds no result file."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _slow_set(
    spec: dict[str, Any],
    device: torch.device,
    equal: dict[str, Runner],
    stretch: Stretch,
    layout: list[int],
    timings: dict[str, float],
) -> tuple[dict[str, Runner], dict[str, Any], list[Runner]]:
    """Phase (c)'s variants: stage times measured on the probe, the split trial, then the set
    planned for them (``stock`` and ``k1_even`` from ``equal``); the split's record for the
    JSON; the other runners built (probe, tried splits). Adds its parts to ``timings``."""
    clock = time.perf_counter()
    # The device model once for every planned variant (the plugin measures it at each build
    # where plan.reference_tflops is unset): one probe_world, outside any step.
    spec = {**spec, "device_model": dataclasses.asdict(probe_world(device))}
    stock = equal["stock"]
    first = probe_runner(spec, device, stock, stretch)
    measured = measure_stage_times(first, stretch, layout, spec, first_probe_steps(spec))
    # The probe's slowed stage gives the device model in place; probe again on its widths.
    spec, probe, measured = refit_and_probe(spec, device, stock, stretch, layout, first, measured)
    timings["probe_s"], clock = time.perf_counter() - clock, time.perf_counter()
    tried, trial = try_splits(spec, device, measured, stretch)
    measured.update(trial_record(trial))
    timings["trial_s"], clock = time.perf_counter() - clock, time.perf_counter()
    # The plugin's split (index 0) stays the plugin's (plan.stage_times); another the trial
    # picked is configured as a user would: parallel.num_layers_per_stage.
    times = measured["stage_times"] if trial.best == 0 else None
    slow_spec = {**spec, "splits": {**spec["splits"], "slow": trial.split}, "stage_times": times}
    # k1_even: the equal set's KFKBSchedule at k = 1 (even split, even widths), so that (c)
    # also gives the split's gain under our executor (k1 over it), not only under Colossal-AI's.
    shared = {"stock": stock, "planned_1f1b": tried[trial.best]}
    if spec.get("even_k1", True):
        shared["k1_even"] = equal["k1"]
    slow = _build_set(slow_spec, "slow", device, shared)
    for runner in slow.values():
        if runner.stretch is None:  # stock and the tried splits have theirs
            stretch.attach(runner.blocks)
            runner.stretch = stretch
    measured["stage_widths"] = stage_widths(slow["planned_1f1b"])
    measured["device_model"] = spec["device_model"]
    timings["build_slow_s"] = time.perf_counter() - clock
    return slow, measured, [first, probe, *tried]


def _decisions(runner: Runner) -> list[dict[str, Any]]:
    control = getattr(runner.plugin, "pipeline_control", None)
    if control is None or control.log is None:
        return []
    return [
        {
            "step": r["step"],
            **r["decision"],
            "predicted_gain": r["predicted_gain"],
            "transfer_s": list(r["inputs"].get("transfer_s", ())),
            # This rank's seconds deciding (profile, simulations, guard) and waiting for the
            # gather before the step it decided: ada's own cost of the retuning.
            "decide_s": r.get("decide_s"),
            "gather_wait_s": r.get("gather_wait_s"),
            # What the choice compared, to check ada's k against the step times run per k.
            **{key: r.get(key) for key in ("model_k", "reason", "ran_k", "measured_s")},
            "predicted_s_by_k": r.get("predicted_s_by_k"),
            # Units of each message per TP link (parallel.pp_link_shares), when decided.
            **({"link_units": r["link_units"]} if "link_units" in r else {}),
        }
        for r in control.log.records
    ]
