"""Phase (c)'s split for ``bench pipeline``: measured stage times, then a short split trial.

The user recipe of docs/pipeline.md, run by every rank of the bench: ``probe_runner`` (Colossal-AI's
1F1B on the even split, with the planned variants' TP widths), ``measure_stage_times`` on it at
phase (c)'s device speeds (``plan.stage_times``), ``try_splits`` (the plugin's split and its
near ties, ``pipeline.split_trial.pick_split``). Collective throughout.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from colossal_hetero.bench.pipeline_fit import fit_device_model
from colossal_hetero.bench.pipeline_model import build_configs, model_config
from colossal_hetero.bench.pipeline_runner import (
    WARM_SEED,
    Runner,
    build_plugins,
    gather_rows,
    workload_of,
)
from colossal_hetero.bench.pipeline_stretch import Stretch
from colossal_hetero.models import build_hf_config
from colossal_hetero.pipeline.split_trial import SplitTrial, pick_split
from colossal_hetero.planner.hf import model_spec_from_hf
from colossal_hetero.planner.stages import StageTimes, split_candidates

TRIAL_SLACK = 0.2
TRIAL_SPLITS = 2
TRIAL_STEPS = 3
"""Phase (c)'s split trial (``try_splits``, ``pipeline.split_trial.pick_split``): the plugin's
split and the best other predicted within 20% of the best, up to 3 steps each (the trial stops
once the last step cannot change its pick). Since session 11 two candidates, not three, for
``--quick``'s time: each costs a build and 2-3 steps at phase (c)'s speeds (~8 s), and the
third ran slowest in every PP=2 x TP=2 trial recorded (session 10's two runs, ``[3, 9]``; one
of session 11 under load, ``[6, 6]``); PP=4's three are near ties (3-5% apart: the third won
2 of 3 runs, worth ~4% of that layout's 1.46-1.57). Under load a stage's measured block time
moves by 10-14% between runs and splits (PP=2 x TP=2's full-speed stage: 10.6 and 12.0
ms in two runs, 8.4 to 9.4 ms over the splits of one experiment): a 5% window left ``[4, 8]``
out (predicted 11% behind), and 12% left it out once more (session 10, load 12: predicted
12.4% behind ``[5, 7]``, which it had beaten by 10% on the idle machine)."""
TRIAL_MARGIN = 0.03
"""How much faster another split's trial steps must run to displace the plugin's (``pick_split``'s
``margin``; 0 until session 21). A trial of 2-3 steps per split, on runners built moments
before, does not rank near ties as phase (c)'s rounds do: in session 21 it measured PP=2 x
TP=2's ``[4, 8]`` 0.6% ahead of the plugin's ``[5, 7]`` (medians 2.457 and 2.471 s; the stage
times predicted ``[5, 7]`` 8% ahead) and the split then read 1.18 [1.14, 1.24], where the
plugin's split had read 1.29-1.39 in the runs before; one run earlier it had taken ``[6, 6]``
over ``[5, 7]`` by 1.4%. A 10% win, as ``[4, 8]``'s on session 10's idle machine, still counts."""


def probe_runner(
    spec: dict[str, Any], device: torch.device, stock: Runner, stretch: Stretch
) -> Runner:
    """What phase (c)'s stage times are measured on: Colossal-AI's 1F1B on the even split with
    the TP widths the planned variants get (``pipeline_model.build_configs``' slow set); under
    PP alone (no widths) ``stock`` itself."""
    if spec["tp"] == 1:
        return stock
    model_cfg, configs = build_configs(spec, "slow", device, layers=spec["splits"]["even"])
    plugin = build_plugins({"probe": configs["planned_1f1b"]}, device, workload_of(spec))["probe"]
    probe = Runner("probe", plugin, model_cfg, spec)
    stretch.attach(probe.blocks)
    probe.stretch = stretch
    return probe


def _split_runner(
    spec: dict[str, Any], device: torch.device, stretch: Stretch, layers: list[int] | None
) -> Runner:
    """Colossal-AI's 1F1B with the planned widths on ``layers``, or (None) on the split the
    plugin plans from ``spec["stage_times"]`` (``plan.stage_times``); warmed, stretched."""
    model_cfg, configs = build_configs(spec, "slow", device, layers=layers)
    plugin = build_plugins({"planned_1f1b": configs["planned_1f1b"]}, device, workload_of(spec))
    runner = Runner("planned_1f1b", plugin["planned_1f1b"], model_cfg, spec)
    runner.step(seed=WARM_SEED)
    stretch.attach(runner.blocks)
    runner.stretch = stretch
    return runner


def try_splits(
    spec: dict[str, Any], device: torch.device, measured: dict[str, Any], stretch: Stretch
) -> tuple[list[Runner], SplitTrial]:
    """Phase (c)'s split as a user gets it: the plugin plans it from the measured stage times
    (``plan.stage_times``), then ``pipeline.split_trial.pick_split`` runs it and the fastest
    other splits those times predict within ``TRIAL_SLACK`` of the best
    (``split_candidates``; ``TRIAL_SPLITS`` in all, each on Colossal-AI's 1F1B with the
    planned widths) ``TRIAL_STEPS`` steps each, stretched, and keeps the least median of the
    slowest rank's step, the plugin's split unless another runs ``TRIAL_MARGIN`` faster. The
    stage times cannot separate near ties: a block's time moves by
    ~10% with the load and what the other stage runs beside it (PP=2 x TP=2: ``[4, 8]``,
    predicted 2% behind ``[5, 7]``, ran 6% ahead of it in every round of one experiment).
    Returns the candidates' runners (the plugin's first) and the trial. Collective."""
    spec = {**spec, "stage_times": measured["stage_times"]}
    runners = [_split_runner(spec, device, stretch, None)]
    first = list(runners[0].plugin.stage_plan.layers_per_stage)
    times = StageTimes(tuple(measured["block_s"]), tuple(measured["fixed_s"]))
    candidates = split_candidates(
        spec["layers"], times, first, slack=TRIAL_SLACK, limit=TRIAL_SPLITS
    )
    runners += [_split_runner(spec, device, stretch, c) for c in candidates[1:]]

    def step_seconds(index: int, step: int) -> float:
        return runners[index].step(seed=WARM_SEED + step)[0]

    stretch.enabled = True
    trial = pick_split(candidates, step_seconds, TRIAL_STEPS, device=device, margin=TRIAL_MARGIN)
    stretch.enabled = False
    return runners, trial


def trial_record(trial: SplitTrial) -> dict[str, Any]:
    """The trial for the JSON: candidates (the plugin's first), their steps, the pick."""
    rows = zip(trial.candidates, trial.steps_s, trial.medians_s, strict=True)
    return {
        "plugin_split": list(trial.candidates[0]),
        "trial": [
            {"split": list(c), "steps_s": list(s), "median_s": m if s else None} for c, s, m in rows
        ],
        "split": trial.split,
        "chosen_by": "plugin (plan.stage_times)" if trial.best == 0 else "trial",
    }


def stage_widths(runner: Runner) -> list[dict[str, list[int]]]:
    """Every rank's planned TP widths (``HeteroParallelPlugin.stage_widths``; {} for even)."""
    mine = {key: list(value) for key, value in runner.plugin.stage_widths.items()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


PROBE_STEPS = 2
"""Measured steps of the probe (``measure_stage_times``; 3 until session 11): the stage times
only choose the trial's candidates, and the trial runs them."""
FIT_PROBE_STEPS = 1
"""Measured steps of the first probe when a second follows on fitted widths
(:func:`refit_and_probe`): the fit reads thread CPU seconds per block pass, an average over a
step's ~100 passes per rank, and its stage times are superseded."""


def first_probe_steps(spec: dict[str, Any]) -> int:
    """Steps of the first probe: :data:`FIT_PROBE_STEPS` under TP (a refit follows), else
    :data:`PROBE_STEPS` (its stage times plan the split)."""
    return FIT_PROBE_STEPS if spec["tp"] > 1 else PROBE_STEPS


def measure_stage_times(
    stock: Runner,
    stretch: Stretch,
    layout: list[int],
    spec: dict[str, Any],
    steps: int = PROBE_STEPS,
) -> dict[str, Any]:
    """Each stage's measured per-block and fixed seconds, for phase (c)'s split.

    ``stock`` (Colossal-AI's 1F1B on the even split, with the planned variants' TP widths:
    ``_probe``) runs ``steps`` steps with ``stretch`` on, every rank at its phase (c) speed
    (after one unrecorded step without it if it has not run yet). Per rank and step: one block's
    forward + backward per micro-batch (the stretch's timed block passes, over the passes
    run, times two) and the rest of the stage's own passes per micro-batch (forward_step +
    backward_step, ``InFlightMeter.busy_s``, less its blocks): embeddings, head and loss,
    Python. Per stage the median over steps of its slowest rank: ``plan.stage_times``, from
    which the plugin balances ``fixed + n * block`` (``try_splits``). ``stretch_by_rank``:
    each rank's stretch totals over those steps (``STRETCH_TOTALS``; ``compute_wall_s`` over
    ``cpu_s`` is the host's contention, which ``dedicated`` absorbs up to its base). Collective.
    """
    assert stock.meter is not None
    m, pp = spec["m"], spec["pp"]
    if stock.steps == 0:  # a fresh probe (PP=2 x TP=2's): its lazy initialisation, unstretched
        stock.step(seed=WARM_SEED + 1)
    stretch.enabled = True
    rows, before = [], stretch_totals(stretch)
    for i in range(steps):
        seconds, passes, busy = stretch.passes_s, stretch.passes, stock.meter.busy_s
        stock.step(seed=WARM_SEED + 2 + i)
        blocks_run = (stretch.passes - passes) / 2  # forward + backward: one block, one batch
        block_s = (stretch.passes_s - seconds) / max(blocks_run, 1.0)
        fixed_s = max(0.0, (stock.meter.busy_s - busy - blocks_run * block_s) / m)
        rows.append(gather_rows([block_s, fixed_s]))
    stretch.enabled = False
    by_rank = stretch_by_rank(before, stretch)

    def stage_median(stage: int, column: int) -> float:
        ranks = [r for r, s in enumerate(layout) if s == stage]
        return statistics.median(max(row[r][column] for r in ranks) for row in rows)

    times = StageTimes(
        tuple(stage_median(s, 0) for s in range(pp)), tuple(stage_median(s, 1) for s in range(pp))
    )
    return {
        "block_s": list(times.block_s),
        "fixed_s": list(times.fixed_s),
        "stage_times": [[b, f] for b, f in zip(times.block_s, times.fixed_s, strict=True)],
        "stretch_by_rank": by_rank,
    }


STRETCH_TOTALS = ("cpu_s", "work_s", "compute_wall_s", "slept_s", "passes_s", "passes", "intervals")
"""``measure_stage_times``' per-rank stretch totals over its measured steps (``Stretch``'s)."""


def stretch_totals(stretch: Stretch) -> list[float]:
    """``stretch``'s running :data:`STRETCH_TOTALS` (a span's are two readings' difference)."""
    return [float(getattr(stretch, name)) for name in STRETCH_TOTALS]


def stretch_by_rank(before: list[float], stretch: Stretch) -> list[dict[str, float]]:
    """Every rank's :data:`STRETCH_TOTALS` since ``before`` (its :func:`stretch_totals` then).
    Collective (one all_gather on the default group)."""
    totals = [b - a for a, b in zip(before, stretch_totals(stretch), strict=True)]
    return [dict(zip(STRETCH_TOTALS, row, strict=True)) for row in gather_rows(totals)]


def refit_and_probe(
    spec: dict[str, Any],
    device: torch.device,
    stock: Runner,
    stretch: Stretch,
    layout: list[int],
    probe: Runner,
    measured: dict[str, Any],
) -> tuple[dict[str, Any], Runner, dict[str, Any]]:
    """Fit the device model to the probe run's slowed stage (``pipeline_fit``), then probe
    again on the widths the plugin plans with it: (spec with the fitted ``device_model``,
    the new probe, its stage times with ``device_fit``: the fit, the first probe's
    widths and times). As it was when the stage has one rank or even widths (no line to fit).
    Collective."""
    if spec["tp"] == 1:  # PP alone: the probe is stock (Colossal-AI's plugin), no widths
        return spec, probe, measured
    widths = stage_widths(probe)
    ranks = [r for r, s in enumerate(layout) if s == spec["slow_stage"]]
    if not widths[ranks[0]]:
        return spec, probe, measured
    model = model_spec_from_hf(
        build_hf_config(model_config(spec)), spec["batch_size"], spec["seq_len"]
    )
    by_rank = measured["stretch_by_rank"]
    points = [(widths[r], i, by_rank[r]) for i, r in enumerate(ranks)]
    fitted = fit_device_model(spec["device_model"], model, spec["batch_size"] // spec["m"], points)
    if fitted is None:
        return spec, probe, measured
    spec = {**spec, "device_model": fitted["device_model"]}
    refit = probe_runner(spec, device, stock, stretch)
    again = measure_stage_times(refit, stretch, layout, spec)
    first = {key: measured[key] for key in ("stage_times", "stretch_by_rank")}
    again["device_fit"] = {**fitted["fit"], "probe": {**first, "stage_widths": widths}}
    return spec, refit, again
