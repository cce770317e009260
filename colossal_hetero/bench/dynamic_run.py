"""``bench dynamic``, the spawned half: every variant of one model in one world, interleaved.

One world of ``tp`` CPU ranks trains every variant side by side, one training step each per
round (``bench.rounds``, order balanced), round ``i`` being step ``i`` of every variant, so
each meets the phase schedule (``dynamic_phases``) at the same step:

- ``unperturbed``: stock ``HybridParallelPlugin``, even TP, no emulation;
- ``stock``: the same under the schedule's slowdowns;
- ``none`` and one variant per available balancer mode: ``HeteroParallelPlugin``, even TP to
  start with (the cluster is declared homogeneous: only the balancer may learn otherwise);
- ``oracle``: ``HeteroParallelPlugin`` planned for each phase's true speeds, moved to the
  next phase's plan (``plugin.resize``, between steps) at the step the phase begins.

All variants start from the same weights and train on the same text batches. A variant's
validation loss is taken at the end of each phase (forward only, outside the timed step).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from colossal_hetero.bench.dynamic_phases import Phase, slowdown_specs
from colossal_hetero.bench.dynamic_variants import World, run_variants
from colossal_hetero.config.balancer import BalancerConfig
from colossal_hetero.config.schema import (
    ClusterConfig,
    DataConfig,
    DeviceSpec,
    EmulationConfig,
    HeteroConfig,
    ModelConfig,
    ParallelConfig,
    PlanConfig,
    SlowdownSpec,
)

BALANCER_KNOBS: dict[str, Any] = {
    "every": 2,
    "window": 3,
    "smoothing": 0.9,
    "threshold": 0.3,
    "release": 0.1,
    "stable_tolerance": 0.25,
    "stable_steps": 2,
    "horizon_steps": 100,
    "move_cost_s": 0.2,
}
"""The benchmark's balancer settings (``fixed_fraction`` is the calibration's first guess,
refined by the controller from each move): an agreement every 2 steps over the median of
the last 3 (a change shows within 2 steps, a re-plan then (a sudden straggler, over 1.6x)
or 2 steps later, inside a 10-step phase;
one gather per step would re-plan no sooner, as stability is counted in steps),
and thresholds wide enough for a loaded 2-core host, where 4 ranks share 2 cores with other
jobs and a rank's compute time jitters by tens of percent; the median and the hysteresis
(flag above 1.3x, release below 1.1x, re-plan only when the planning speeds left the plan's by 25%)
keep that jitter from moving the widths."""

TEXT_KNOBS: dict[str, Any] = {**BALANCER_KNOBS, "accuracy_weight": 1.0}
"""The throughput run's: ``accuracy_weight`` 1 prices dropping a fraction of the work as high
as the time it saves, so semi never bridges with ZERO-resizing on text (at 0.5 a --quick
run under load lost 15% validation loss to it, against the issue's 1%); it bridges with
migration or re-plans. (The digits run keeps ``BALANCER_KNOBS``.)"""


@dataclass(frozen=True)
class ThroughputCase:
    """One model of the throughput run."""

    name: str
    model: ModelConfig
    phases: tuple[Phase, ...]
    modes: tuple[str, ...]
    """Balancer modes to run (besides none), those available in this build."""
    warmup: int = 2
    batch_size: int = 8
    seq_len: int = 64
    eval_batches: int = 2
    knobs: dict[str, Any] = field(default_factory=lambda: dict(TEXT_KNOBS))

    @property
    def steps(self) -> int:
        return self.phases[-1].end

    @property
    def world(self) -> int:
        return len(self.phases[0].factors)


DEVICE_BASE = 2.5
"""Every rank emulates a device this many times slower than a core, its compute stretched to
``base x factor x`` its CPU work (the interceptor's ``dedicated`` stretch): 4 ranks share 2
cores, so a rank's wall time per unit of work is about 2x its CPU work and moves with what
the others do. With ``added`` stretch a slowed rank's sleep hands its core to the others
(the 2x rank of phase 1 cost stock TP 4% instead of its compute's worth); a base above the
contention gives each rank a device of its own that no neighbour speeds up."""


def emulation_of(phases: tuple[Phase, ...], base: float = 1.0) -> EmulationConfig:
    """The schedule's compute slowdowns as an emulation config, on devices ``base`` times
    slower than a core (1: the factors alone)."""
    specs = slowdown_specs(phases, base)
    return EmulationConfig(compute=[SlowdownSpec(**spec) for spec in specs])


CALIBRATION = (Phase("even", 0, 8, (1.0,) * 4), Phase("skew", 8, 16, (1.0, 1.0, 2.5, 2.5)))
"""The fixed-fraction calibration: 8 steps at even widths, then 8 at the planner's widths for
speeds (1, 1, 0.4, 0.4), every rank on the base device (no straggler): each rank's work moves
by 0.43 of an even split, so all four give an estimate. Only the widths follow the factors.
Each estimate moves by 1 / 0.43 = 2.3 times a rank's error in its time ratio: with 4 steps
a phase (medians of 3), the idle session-9 runs read GPT-2 at 0.33 and 0.58 (session 10:
8 steps a phase, medians of 7, about 1.5 s more per model)."""


def calibrate_fixed_fraction(
    case: ThroughputCase, config: HeteroConfig, data: Any, device: torch.device
) -> float | None:
    """The work model's fixed fraction measured on the benchmark's own layout, before the run:
    one variant trains ``CALIBRATION`` (the oracle's move to the skewed widths at step 4) and
    ``fixed_fraction_from_move`` fits each rank's median compute before (steps 1-3) and after
    (5-7; step 4 warms up the new shapes), shares weighted as the controller weighs them.

    A one-process step at one feature per head (``_fixed_fraction``) misses the layers every
    rank runs at full width (norms, embeddings, the loss): 0.05 there against 0.25 to 0.35
    fitted online on the emulated devices, so the first re-plan of a run planned with the
    wrong model and a second one followed once the controller had fitted it."""
    assert config.emulation is not None
    world = _world(case, CALIBRATION, data, config.emulation, seed=1, eval_batches=1, warmup=1)
    from types import SimpleNamespace

    from colossal_hetero.balance.wiring import key_compute
    from colossal_hetero.models import build_hf_config

    result = run_variants(world, {}, {"probe": config}, device, oracle="probe")
    rows = result["variants"]["probe"]["rows"]
    hf = SimpleNamespace(config=build_hf_config(case.model))  # what key_compute reads
    compute = key_compute(hf, (case.batch_size, case.seq_len), 1)
    return fixed_fraction_of_rows(rows, result["oracle_widths"], compute, case.world)


def _world(
    case: ThroughputCase,
    phases: tuple[Phase, ...],
    data: Any,
    cluster: EmulationConfig,
    *,
    seed: int,
    eval_batches: int,
    warmup: int | None = None,
) -> World:
    """The spawned world of ``case`` over ``phases``: its text batches (data order ``seed``),
    every rank on the dedicated-device stretch of ``cluster``."""
    return World(
        model=case.model,
        phases=phases,
        warmup=case.warmup if warmup is None else warmup,
        batch_size=case.batch_size,
        seq_len=case.seq_len,
        train_batch=lambda step: data.train_batch(step, case.batch_size, seed),
        val_batches=data.val_batches(case.batch_size, eval_batches),
        stretch="dedicated",
        cluster=cluster,
    )


def fixed_fraction_of_rows(
    rows: list[list[float]],
    widths: list[dict[str, list[int]]],
    compute: dict[str, float] | None,
    size: int,
) -> float | None:
    """``fixed_fraction_from_move`` from ``CALIBRATION``'s rows (``[step, compute, wait,
    loss] * ranks`` per step) and its two widths: per rank the median compute of each phase's
    steps after its first (which warms up the shapes)."""
    from colossal_hetero.balance.detector import fixed_fraction_from_move, shares_of

    def medians(phase: Phase) -> list[float]:
        steps = range(phase.start + 1, phase.end)
        return [statistics.median(rows[s][1 + 4 * r] for s in steps) for r in range(size)]

    (first, second), (even, skew) = CALIBRATION, (shares_of(w, size, compute) for w in widths)
    return fixed_fraction_from_move(medians(first), even, medians(second), skew)


def unperturbed_of(phases: tuple[Phase, ...], base: float = DEVICE_BASE) -> EmulationConfig:
    """Every rank at the device base alone (no straggler), the same length of run."""
    even = tuple(Phase(p.name, p.start, p.end, (1.0,) * len(p.factors)) for p in phases)
    return emulation_of(even, base)


def balancer_config(mode: str, knobs: dict[str, Any], fixed_fraction: float) -> BalancerConfig:
    """The benchmark's balancer section for ``mode`` (ConfigError where it cannot run)."""
    return BalancerConfig(mode=mode, fixed_fraction=fixed_fraction, **knobs)  # type: ignore[arg-type]


def fixed_fraction_of(step_s: float, fixed_s: float, tp: int) -> float:
    """The part of a rank's even-TP compute that does not scale with its widths, from a
    single-process step (``step_s``) and the same model at one feature per head (``fixed_s``):
    ``fixed / (fixed + (step - fixed) / tp)``, clipped to ``[0, 0.9]``."""
    scaling = max(step_s - fixed_s, 0.0) / tp
    total = fixed_s + scaling
    return min(max(fixed_s / total if total > 0 else 0.0, 0.0), 0.9)


def throughput_rank(
    rank: int, world_size: int, device: torch.device, case: ThroughputCase
) -> dict[str, Any]:
    """Spawned on every rank: calibrate, build the variants, run the rounds, evaluate.

    Returns (identical on every rank) per variant: every step's per-rank row (step,
    compute, wait, loss), the bytes every step sent summed over ranks, the validation
    losses by phase, and the balancer's decision records (rank 0's copy; they are agreed).
    """
    from colossal_hetero.bench.profile import agree, calibrate_model, measure_allreduce_gbps
    from colossal_hetero.plugin import prepare_device
    from colossal_hetero.utils.device import device_kind

    prepare_device(device)
    started = time.perf_counter()
    rate, overhead = calibrate_model(case.model, case.batch_size, case.seq_len, device)
    tflops = agree(rate, device, "max") / 1e12
    overhead = agree(overhead, device, "min")
    gbps = agree(measure_allreduce_gbps(device), device, "min")
    single = _fixed_fraction(case, tflops * 1e12, overhead)
    kind = device_kind(device)
    plan = PlanConfig(mode="auto", reference_tflops=tflops, layer_overhead_us=overhead * 1e6)
    emulation = emulation_of(case.phases, DEVICE_BASE)

    def hetero(mode: str, speeds: tuple[float, ...], fraction: float) -> HeteroConfig:
        devices = [DeviceSpec(speed=s, bandwidth_gbps=gbps) for s in speeds]
        return HeteroConfig(
            parallel=ParallelConfig(tp=world_size),
            cluster=ClusterConfig(device=kind, devices=devices),
            emulation=emulation,
            plan=plan,
            balancer=balancer_config(mode, case.knobs, fraction),
        )

    data = text_data(case)
    even = (1.0,) * world_size
    probe = replace(hetero("none", even, single), emulation=unperturbed_of(CALIBRATION))
    measured = calibrate_fixed_fraction(case, probe, data, device)
    fraction = measured if measured is not None else single
    configs = {mode: hetero(mode, even, fraction) for mode in ("none", *case.modes)}
    configs["oracle"] = hetero("none", case.phases[0].speeds, fraction)
    world = _world(case, case.phases, data, emulation, seed=0, eval_batches=case.eval_batches)
    stock = {"unperturbed": unperturbed_of(case.phases, DEVICE_BASE), "stock": emulation}
    calibrated_s = time.perf_counter() - started
    result = run_variants(world, stock, configs, device, oracle="oracle")
    result["seconds"]["calibrate"] = calibrated_s
    result["calibration"] = {
        "reference_tflops": tflops,
        "layer_overhead_s": overhead,
        "allreduce_gbps": gbps,
        "fixed_fraction": fraction,
        "fixed_fraction_single_process": single,
        "fixed_fraction_measured": measured,
    }
    return result


def _fixed_fraction(case: ThroughputCase, rate: float, overhead: float) -> float:
    """``fixed_fraction_of`` from the calibration: the fixed part is the per-layer overhead
    times the layers, the scaling part the model's FLOPs at the calibrated rate."""
    from colossal_hetero.models import build_hf_config
    from colossal_hetero.planner.cost import BACKWARD_FLOPS_FACTOR
    from colossal_hetero.planner.hf import model_spec_from_hf

    spec = model_spec_from_hf(build_hf_config(case.model), case.batch_size, case.seq_len)
    flops = sum(
        case.batch_size * layer.flops_per_token * layer.tokens * (1.0 + BACKWARD_FLOPS_FACTOR)
        for layer in spec.layers
    )
    fixed = overhead * len(spec.layers)
    return fixed_fraction_of(fixed + flops / rate, fixed, case.world)


def text_data(case: ThroughputCase) -> Any:
    """The pydoc text the variants train and validate on."""
    from colossal_hetero.data import build_data

    data = DataConfig(
        dataset="pydoc_topics", seq_len=case.seq_len, global_batch_size=case.batch_size
    )
    return build_data(data, case.model.arch)
