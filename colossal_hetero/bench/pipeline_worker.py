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
- ``k1_even`` (phase c only): the equal set's ``k1`` (``KFKBSchedule``, ``k = 1``, even split
  and widths), the even split under our executor.

Phases (a) and (b) share one set (equal speeds: the planned split is the planner's for equal
stages); phase (c) slows one device to half speed (``bench.pipeline_stretch``) and uses a second
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

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from colossalai.booster import Booster

from colossal_hetero.bench.measure import text_batch
from colossal_hetero.bench.pipeline_model import DEVICE_BASE, ROW, build_configs, stage_peaks
from colossal_hetero.bench.pipeline_stretch import Stretch
from colossal_hetero.bench.rounds import (
    Figure,
    RoundsPolicy,
    Variant,
    rank0_decides,
    run_rounds,
)
from colossal_hetero.bench.shaped_spawn import report_bench_step
from colossal_hetero.compat.attention import keep_gpt2_causal
from colossal_hetero.config.schema import HeteroConfig, ModelConfig
from colossal_hetero.models import build_model, loss_from_outputs
from colossal_hetero.pipeline.profile import (
    predict_from_records,
    record_from_vector,
    vector_width,
)
from colossal_hetero.pipeline.schedule import KFKBSchedule
from colossal_hetero.pipeline.split_trial import SplitTrial, pick_split
from colossal_hetero.pipeline.tuner import stage_of_rank
from colossal_hetero.planner.stages import StageTimes, split_candidates

WARM_SEED = 10**6
"""Batch seed of each variant's unrecorded first step (rounds use their global number)."""
TRIAL_SLACK = 0.2
TRIAL_SPLITS = 3
TRIAL_STEPS = 3
"""Phase (c)'s split trial (``try_splits``, ``pipeline.split_trial.pick_split``): the plugin's
split and candidates within 20% of the best predicted, at most 3, up to 3 steps each (the
trial stops once the last step cannot change its pick). Under load a stage's measured block
time moves by 10-14% between runs and splits (PP=2 x TP=2's full-speed stage: 10.6 and 12.0
ms in two runs, 8.4 to 9.4 ms over the splits of one experiment): a 5% window left ``[4, 8]``
out (predicted 11% behind), and 12% left it out once more (session 10, load 12: predicted
12.4% behind ``[5, 7]``, which it had beaten by 10% on the idle machine)."""


class InFlightMeter:
    """Peak activation bytes of a stock (Colossal-AI) schedule, measured like ``KFKBSchedule``
    does: bytes autograd saves in each ``forward_step`` (parameters excluded, a storage once),
    held from that forward to the micro-batch's ``backward_step`` (which frees them, FIFO)."""

    def __init__(self, schedule: Any, model: Any) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: list[int] = []
        self.peak_bytes = 0
        self.busy_s = 0.0
        """Wall seconds in forward_step and backward_step so far: the stage's own passes."""
        forward, backward = schedule.forward_step, schedule.backward_step

        def forward_step(*args: Any, **kwargs: Any) -> Any:
            seen: set[int] = set()
            total = 0
            started = time.perf_counter()

            def pack(t: torch.Tensor) -> torch.Tensor:
                nonlocal total
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self._params and ptr not in seen:
                    seen.add(ptr)
                    total += t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = forward(*args, **kwargs)
            self.busy_s += time.perf_counter() - started
            self.live.append(total)
            self.peak_bytes = max(self.peak_bytes, sum(self.live))
            return out

        def backward_step(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = backward(*args, **kwargs)
            self.busy_s += time.perf_counter() - started
            if self.live:
                self.live.pop(0)
            return out

        schedule.forward_step, schedule.backward_step = forward_step, backward_step

    def take_peak(self) -> int:
        peak, self.peak_bytes, self.live = self.peak_bytes, 0, []
        return peak


class Runner:
    """One variant: a plugin, its boosted model and optimizer, stepped with a batch on demand."""

    def __init__(self, name: str, plugin: Any, model_cfg: ModelConfig, spec: dict[str, Any]):
        self.name, self.plugin, self.spec = name, plugin, spec
        torch.manual_seed(0)
        model = build_model(model_cfg)
        keep_gpt2_causal(model)  # every variant computes the same causal model
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.booster = Booster(plugin=plugin)
        self.model, self.optimizer, self.criterion, _, _ = self.booster.boost(
            model, optimizer, loss_from_outputs
        )
        engine = getattr(plugin, "engine", plugin)
        self.schedule = engine.scheduler
        self.kfkb = isinstance(self.schedule, KFKBSchedule)
        self.meter = None if self.kfkb else InFlightMeter(self.schedule, self.model)
        self.blocks = list(self.model.unwrap().transformer.h)
        self.stretch: Stretch | None = None
        """Set on the slowed stage's ranks for the variants of phase (c)."""
        self.steps = 0
        """Steps run so far (a first step pays lazy initialisation)."""

    @property
    def k(self) -> int:
        return int(self.schedule.k) if self.kfkb else 1

    def step(self, seed: int) -> list[float]:
        """One training step; this rank's row (``pipeline_model.ROW``), not yet gathered."""
        batch = text_batch(self.spec["batch_size"], self.spec["seq_len"], seed)
        slept = 0.0 if self.stretch is None else self.stretch.slept_s
        dist.barrier()
        started = time.perf_counter()
        self.booster.execute_pipeline(iter([batch]), self.model, self.criterion, self.optimizer)
        piped = time.perf_counter()
        k = self.k  # the k this step ran: ada decides as a step starts (before_step)
        self.optimizer.step()
        self.optimizer.zero_grad()
        ended = time.perf_counter()
        if self.kfkb:
            peak = self.schedule.last_stats.activation_bytes * self.schedule.peak_saved
        else:
            assert self.meter is not None
            peak = self.meter.take_peak()
        if self.stretch is not None:
            slept = self.stretch.slept_s - slept
        self.steps += 1
        return [ended - started, piped - started, float(k), float(peak), slept]

    def prediction(self, k: int) -> tuple[float, float]:
        """(simulated, measured) seconds of the last step's schedule, run with ``k`` (ada may
        have retuned since), from every rank's ``last_record``
        (``pipeline.profile.predict_from_records``; one all_gather)."""
        m = self.spec["m"]
        rows = _gather(self.schedule.last_record.to_vector(m))
        records = [record_from_vector(row, m) for row in rows]
        assert len(rows[0]) == vector_width(m)
        found = predict_from_records(records, m, k)
        return found.predicted_s, found.measured_s


def _gather(row: list[float]) -> list[list[float]]:
    mine = torch.tensor(row, dtype=torch.float64)
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [r.tolist() for r in rows]


class Phases:
    """Global round numbering, tenant settling, and each variant as a rounds-helper variant."""

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        self.spec, self.rank = spec, rank
        self.layout = stage_of_rank(spec["pp"], spec["tp"], 1)
        self.offset = 0
        """Global number of the running phase's first round (its warm-up included)."""
        self._reported = -1

    def _enter_round(self, index: int) -> tuple[int, bool]:
        """The round's global number, and whether this step is the first after a tenant
        stretch (its variant then runs one unrecorded step first: ``drain_s``)."""
        number = self.offset + index
        if number == self._reported:
            return number, False
        report_bench_step(self.rank, number)  # the round's first step
        drain = self.drain_s(number)
        time.sleep(self.settle_s(number) + drain)
        dist.barrier()
        self._reported = number
        return number, drain > 0

    def settle_s(self, number: int) -> float:
        """The wait before round ``number`` for the tenant to start or stop: ``settle_s`` when
        the targeted link's share changes from the round before, else none (the rounds of
        phases a and c, and those inside a stretch, change nothing on the link)."""
        shares = self.spec["shares"]
        changed = 0 < number < len(shares) and shares[number - 1] != shares[number]
        return float(self.spec["settle_s"]) if changed else 0.0

    def drain_s(self, number: int) -> float:
        """Extra wait before round ``number`` when it is the first free round after a tenant
        stretch: the link's queue still drains the tenant's bytes, and whichever variant ran
        first paid for it (PP=4, phase b: the variant first in that round 516-593 ms, 311 ms
        in the other free round), the same variant every run as the rotation is fixed. A wait
        alone left it ~1.3x its median against the others' (one run, load 14), so that
        variant also runs one unrecorded step on the link first."""
        shares = self.spec["shares"]
        after = 0 < number < len(shares) and shares[number - 1] < 1.0 <= shares[number]
        return float(self.spec.get("drain_s", 0.0)) if after else 0.0

    def variant(self, runner: Runner) -> Variant:
        spec, layout = self.spec, self.layout

        def run(index: int, *, warmup: bool) -> dict[str, float] | None:
            number, drain = self._enter_round(index)
            if drain:  # unrecorded: what the tenant left on the link is paid here
                runner.step(seed=WARM_SEED)
            rows = _gather(runner.step(seed=number))
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


def _plugins(
    configs: dict[str, HeteroConfig | dict[str, Any]],
    device: torch.device,
    workload: tuple[int, int] | None = None,
) -> dict:
    """Each variant's plugin; ``workload`` (global batch, sequence length) for the plugin's
    stage plan (its micro-batch size)."""
    from colossalai.booster.plugin import HybridParallelPlugin

    from colossal_hetero.plugin import HeteroParallelPlugin

    built: dict[str, Any] = {}
    for name, config in configs.items():
        if isinstance(config, dict):  # stock: HybridParallelPlugin keyword arguments
            built[name] = HybridParallelPlugin(**config)
        else:
            built[name] = HeteroParallelPlugin(config, workload=workload)
    return built


def _workload(spec: dict[str, Any]) -> tuple[int, int]:
    """(global batch, sequence length): what the plugins plan stages and widths for."""
    return spec["batch_size"], spec["seq_len"]


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
    ada_config = configs.pop("ada")
    configs = {name: config for name, config in configs.items() if name not in shared}
    for name, plugin in _plugins(configs, device, _workload(spec)).items():
        runners[name] = Runner(name, plugin, model_cfg, spec)
        runners[name].step(seed=WARM_SEED)  # warm: lazy initialisation, first allocations
    budget = _budget_from(runners["k1"], spec)
    assert isinstance(ada_config, HeteroConfig)
    ada_config = build_configs(spec, split, device, ada_budget_mib=budget)[1]["ada"]
    plugin = _plugins({"ada": ada_config}, device, _workload(spec))["ada"]
    runners["ada"] = Runner("ada", plugin, model_cfg, spec)
    runners["ada"].step(seed=WARM_SEED)
    runners["ada"].budget_mib = budget  # type: ignore[attr-defined]
    return runners


def _rounds(phases: Phases, runners: dict[str, Runner], rounds: int, warmup: int) -> Any:
    policy = RoundsPolicy(warmup=warmup, min_rounds=rounds, max_rounds=rounds, budget_s=1e9)
    variants = {name: phases.variant(r) for name, r in runners.items()}
    decide = rank0_decides(torch.device("cpu"))
    return run_rounds(variants, _figures(list(runners)), policy, decide=decide)


def run_pipeline_worker(
    *, rank: int, world_size: int, device: torch.device, spec: dict[str, Any]
) -> dict[str, Any]:
    """Every phase on this rank; rank-identical results (from all-gathered rows)."""
    from colossal_hetero.plugin import prepare_device

    prepare_device(device)  # the gloo/CPU fixes Colossal-AI's stock plugin needs too
    started = time.perf_counter()
    phases = Phases(spec, rank)
    equal = _build_set(spec, "equal", device, {})
    # Phase (c) runs every rank on an emulated device of its own (``dedicated``: no neighbour's
    # sleep speeds it up), the slow ranks' at half speed (bench/pipeline_stretch.py).
    slowed = rank in spec["slow_ranks"]
    factor = spec["slow_factor"] if slowed else 1.0
    stretch = Stretch(factor, mode="dedicated", base=spec.get("device_base", DEVICE_BASE))
    stock = equal["stock"]
    stretch.attach(stock.blocks)
    stock.stretch = stretch
    probe = _probe(spec, device, stock, stretch)
    measured = measure_stage_times(probe, stretch, phases.layout, spec)
    tried, trial = try_splits(spec, device, measured, stretch)
    measured.update(_trial_record(trial))
    # The plugin's split (index 0) stays the plugin's (plan.stage_times); another the trial
    # picked is configured as a user would: parallel.num_layers_per_stage.
    times = measured["stage_times"] if trial.best == 0 else None
    slow_spec = {**spec, "splits": {**spec["splits"], "slow": trial.split}, "stage_times": times}
    # k1_even: the equal set's KFKBSchedule at k = 1 (even split, even widths), so that (c)
    # also gives the split's gain under our executor (k1 over it), not only under Colossal-AI's.
    shared = {"stock": stock, "planned_1f1b": tried[trial.best], "k1_even": equal["k1"]}
    slow = _build_set(slow_spec, "slow", device, shared)
    for runner in slow.values():
        if runner.stretch is None:  # stock and the tried splits have theirs
            stretch.attach(runner.blocks)
            runner.stretch = stretch
    measured["stage_widths"] = _stage_widths(slow["planned_1f1b"])
    setup_s = time.perf_counter() - started
    out: dict[str, Any] = {"setup_s": setup_s, "phases": {}, "measured_split": measured}
    for name, runners in (("a", equal), ("b", equal), ("c", slow)):
        phase = spec["phases"][name]
        stretch.enabled = name == "c"
        phases.offset = phase["start"]
        result = _rounds(phases, runners, phase["rounds"], phase["warmup"])
        out["phases"][name] = result.to_dict()
        out["phases"][name]["figure_series"] = result.figure_series
        out["phases"][name]["first_round"] = phase["start"] + phase["warmup"]
    out["ada"] = {
        split: {
            "budget_mib": runners["ada"].budget_mib,  # type: ignore[attr-defined]
            "decisions": _decisions(runners["ada"]),
        }
        for split, runners in (("equal", equal), ("slow", slow))
    }
    every = (*equal.values(), *slow.values(), probe, *tried)
    for runner in {id(r): r for r in every}.values():
        close = getattr(runner.plugin, "close", None)
        if close is not None:
            close()
    return out


def _probe(spec: dict[str, Any], device: torch.device, stock: Runner, stretch: Stretch) -> Runner:
    """What phase (c)'s stage times are measured on: Colossal-AI's 1F1B on the even split with
    the TP widths the planned variants get (``pipeline_model.build_configs``' slow set); under
    PP alone (no widths) ``stock`` itself."""
    if spec["tp"] == 1:
        return stock
    model_cfg, configs = build_configs(spec, "slow", device, layers=spec["splits"]["even"])
    plugin = _plugins({"probe": configs["planned_1f1b"]}, device, _workload(spec))["probe"]
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
    plugin = _plugins({"planned_1f1b": configs["planned_1f1b"]}, device, _workload(spec))
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
    slowest rank's step. The stage times cannot separate near ties: a block's time moves by
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
    trial = pick_split(candidates, step_seconds, TRIAL_STEPS, device=device)
    stretch.enabled = False
    return runners, trial


def _trial_record(trial: SplitTrial) -> dict[str, Any]:
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


def _stage_widths(runner: Runner) -> list[dict[str, list[int]]]:
    """Every rank's planned TP widths (``HeteroParallelPlugin.stage_widths``; {} for even)."""
    mine = {key: list(value) for key, value in runner.plugin.stage_widths.items()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def measure_stage_times(
    stock: Runner, stretch: Stretch, layout: list[int], spec: dict[str, Any], steps: int = 3
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
    rows, before = [], _stretch_totals(stretch)
    for i in range(steps):
        seconds, passes, busy = stretch.passes_s, stretch.passes, stock.meter.busy_s
        stock.step(seed=WARM_SEED + 2 + i)
        blocks_run = (stretch.passes - passes) / 2  # forward + backward: one block, one batch
        block_s = (stretch.passes_s - seconds) / max(blocks_run, 1.0)
        fixed_s = max(0.0, (stock.meter.busy_s - busy - blocks_run * block_s) / m)
        rows.append(_gather([block_s, fixed_s]))
    stretch.enabled = False
    totals = [b - a for a, b in zip(before, _stretch_totals(stretch), strict=True)]

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
        "stretch_by_rank": [dict(zip(STRETCH_TOTALS, row, strict=True)) for row in _gather(totals)],
    }


STRETCH_TOTALS = ("cpu_s", "compute_wall_s", "slept_s", "passes_s", "passes", "intervals")
"""``measure_stage_times``' per-rank stretch totals over its measured steps (``Stretch``'s)."""


def _stretch_totals(stretch: Stretch) -> list[float]:
    return [float(getattr(stretch, name)) for name in STRETCH_TOTALS]


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
        }
        for r in control.log.records
    ]
