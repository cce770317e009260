"""``colossal-hetero bench pipeline``: kFkB and Ada-Grouper against Colossal-AI's 1F1B.

Two layouts of a small GPT-2 on 4 CPU ranks, PP=4 and PP=2 x TP=2, each one launch on real
shaped links (``bench.shaped_spawn``; model mode when shaped links cannot be built, said in
``network_mode``). In each launch every variant (``bench.pipeline_worker``) runs side by side,
interleaved round by round on the rounds helper, through three phases:

- (a) no preemption;
- (b) a preemption trace: a tenant process pushes real TCP into one stage's rank, paced to take
  80-90% of its link, for stretches of rounds (``kind: tenant`` preemptions, applied by the
  shaped launcher at the round numbers the ranks report);
- (c) one device at half speed (``bench.pipeline_stretch``; ``slow_ranks``: stage 1's rank
  of PP=4, one of stage 0's two tensor-parallel ranks of PP=2 x TP=2), no preemption. The
  planned variants are told the devices' speeds (``cluster.devices``, ``plan.mode: auto``), so
  the plugin plans each stage's tensor-parallel widths (uneven on the stage with the slow
  device), and are given each stage's per-block and fixed seconds measured at those speeds
  and widths at the start of the run on Colossal-AI's 1F1B
  (``pipeline_split.measure_stage_times``) as ``plan.stage_times``: the plugin plans the
  split from them, as for a user. The near-tied splits the measurement cannot separate are
  then run a few steps each with ``pipeline.split_trial.pick_split`` and the fastest is kept
  (``pipeline_split.try_splits``; a split other than the plugin's is then configured as
  ``parallel.num_layers_per_stage``, the user recipe of docs/pipeline.md).

Every rank computes on an emulated device of its own in every phase (``Stretch``,
``dedicated``; the same for every variant): ``free_base`` (2.5) times slower than a core in (a)
and (b), ``device_base`` (6) in (c). Unstretched, the 4 ranks shared the host's 2 cores, so a
stage's compute depended on what the other stages ran beside it: a cost of the host, not of
the schedule (the simulator, which gives each stage its device, missed PP=4's (a) and (b) by
up to 10-20% per step, against 1-2% in (c)).

Every figure is a median of per-round ratios of the slowest rank's step times (paired: one
round's variants saw the same load and network state) with a bootstrap 95% interval
(``bench.stats``). The summary keys, each the worst over the two layouts:

- ``ada_vs_1f1b_preempted`` / ``_unpreempted``: Colossal-AI's 1F1B (stock plugin, even split)
  step time over ada_kfkb's, in phase (b)'s preempted rounds / in phase (a);
- ``ada_vs_best_static_k``: per phase, the best static ``k``'s step time over ada's, the best
  being the one with the least median step time among those whose measured peaks fit ada's
  memory budget (a static ``k`` that breaks the limit is no option for ada);
- ``planned_vs_even_split_slow_stage``: phase (c), Colossal-AI's 1F1B on the even split over
  the same schedule on the planned split;
- ``planned_vs_even_split_slow_stage_kfkb_k1``: the same split under our executor:
  ``KFKBSchedule`` at ``k = 1`` (1F1B's order, non-blocking p2p) on the even split (``k1_even``,
  even widths) over ``k1`` on the planned split (planned widths); full runs only (``even_k1``);
- (a layout's figures, not the summary) ``link_shares_vs_equal_pieces_preempted`` /
  ``_unpreempted``: ``ada`` (equal message pieces, the default) over ``ada_link_shares``
  (``parallel.pp_link_shares: true``), in (b)'s preempted rounds / in (a): the link shares'
  own gain; full runs of layouts with TP only (``link_shares_variant``);
- ``sim_max_error``: per kFkB variant and phase, the median over rounds of
  ``|simulated - measured| / measured`` step time (execute_pipeline), the simulator fed with
  that step's own per-stage compute and message bytes; the largest;
- ``memory_limit_exceeded``: whether any measured stage peak of ada exceeded its budget.

``COLOSSAL_HETERO_BENCH_PIPELINE_LAYOUTS`` (``pp4``, ``pp2xtp2`` or both, comma-separated) runs
only those layouts, for iterating on one; the JSON records it as ``layouts_only`` and its
summary then covers those layouts alone.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from colossal_hetero.bench.pipeline_model import DEVICE_BASE, device_speeds, preemptions
from colossal_hetero.bench.stats import ratio_interval
from colossal_hetero.planner.stages import split_layers, stage_speeds

WORLD = 4
RATE_GBPS = 0.02
"""Stage links: 20 Mbit/s, so one micro-batch's activation takes a few ms, as its compute."""
MIXED_RATE_GBPS = 0.007
"""PP=2 x TP=2's stage links: 7 Mbit/s. Its micro-batch (2 samples, 32 KiB of hidden states)
computes about 3x longer than PP=4's (tensor-parallel all-reduces on CPU), and at 20 Mbit/s the
preempted link then cost 1F1B only ~20% (idle machine, session 4) while kFkB hid all of it: no
schedule could gain 1.3x there. 10 Mbit/s until session 16, when (a) and (b) moved onto
emulated devices 2.5x slower than a core (``free_base``; ~1.3x slower steps than the shared
cores on session 16's host): the tenant then cost stock 1F1B 1.29x at 10 Mbit/s and 1.18x at 13
(``--quick``, this layout alone), 1.65x at 7, near its 1.46-1.58x of session 14 (10 Mbit/s,
unstretched, a faster host). A free transfer (37 ms) still hides behind a backward (~95 ms)."""
FAST_GBPS = 1.0
"""TP pairs inside a stage."""
SHAPED_TIMEOUT_S = 900.0
LAYOUTS_ENV = "COLOSSAL_HETERO_BENCH_PIPELINE_LAYOUTS"
"""Run only these layouts (comma-separated names; unset or empty: all)."""
QUICK_TARGET_S = 270.0
"""``--quick`` aims to end this long after it starts (the issue allows 5 minutes; the rest is
headroom for a round's overrun and the report). Each layout gets a deadline from it
(:func:`layout_deadline`) and its phases stop early on a machine too slow for all their
rounds: session 15's host ran every step ~30% slower than session 14's and took 356 s."""
LAYOUT_SHARES = {"pp4": 107.0, "pp2xtp2": 180.0}
"""Each layout's weight in the time left (its wall seconds in session 14's idle ``--quick``)."""
PREEMPT_PATTERN = (0.15, 0.15, 0.15, 1.0, 0.1, 0.1, 0.1, 1.0)
"""Phase (b)'s job share of the targeted link per round: 1 is free; 0.15 and 0.1 leave 15% and
10% (the tenant takes 85% and 90%). Repeated to the phase's length. It opens with the tenant:
phase (a)'s rounds before it are free (until session 19 it opened with a free round, which a
``--quick`` at its least rounds paid for and no summary figure used)."""


PHASE_C_BASE = 6.0
"""Phase (c)'s device base. At ``DEVICE_BASE`` (2.5) the host's contention (4 ranks on 2 cores)
is about as large as the base, so the half-speed device cost stock PP=2 x TP=2 only ~1.2x
(session 9, H1): the scenario did not hold a half-speed device. At 6 each emulated device
is its own, and compute outweighs the TP all-reduces as on a real cluster."""


@dataclass(frozen=True)
class BenchSpec:
    """One launch: a layout, the model, the variants and the round plan (see module doc)."""

    name: str
    pp: int
    tp: int
    m: int
    target_rank: int
    slow_stage: int
    """The stage holding the half-speed device of phase (c)."""
    slow_ranks: tuple[int, ...] = ()
    """Phase (c)'s half-speed devices (ranks of ``slow_stage``)."""
    quick: bool = True
    layers: int = 12
    hidden: int = 128
    heads: int = 4
    seq_len: int = 32
    batch_size: int = 16
    ks: tuple[int, ...] = (1, 2, 4)
    retune_every: int = 1
    budget_microbatches: float = 0.0
    """ada's budget in micro-batches of the largest measured activations (0: 3/4 of m)."""
    rate_gbps: float = RATE_GBPS
    fast_gbps: float = FAST_GBPS
    slow_factor: float = 2.0
    device_base: float = PHASE_C_BASE
    """Phase (c)'s emulated devices: this many times slower than a core
    (``pipeline_stretch.Stretch(base=)``); it sets how far compute outweighs the TP
    all-reduces and stage links on the emulated cluster."""
    free_base: float = DEVICE_BASE
    """Phases (a) and (b)'s emulated devices (every rank at full speed): this many times slower
    than a core, so that each stage computes on a device of its own, as on a cluster, rather
    than sharing the host's 2 cores with the other stages (see :data:`DEVICE_BASE`)."""
    settle_s: float = 0.3
    drain_s: float = 1.0
    """Extra wait before the first free round after a tenant stretch (its bytes still queued
    on the link; ``pipeline_worker.Phases.drain_s``)."""
    even_k1: bool = True
    """Phase (c) also runs ``k1_even`` (``KFKBSchedule`` at ``k = 1`` on the even split): the
    extra ``planned_vs_even_split_slow_stage_kfkb_k1``. Full runs only since session 11: in
    ``--quick`` its 4 steps at phase (c)'s speeds cost ~14 s of the 5 minutes."""
    link_shares_variant: bool = False
    """Phases (a) and (b) also run ``ada_link_shares`` (``ada`` with message pieces sized by
    the links, ``parallel.pp_link_shares: true``): the link shares' own gain,
    ``link_shares_vs_equal_pieces_*``. Full runs of layouts with TP only (a sixth variant)."""
    network_mode: str = "shaped"
    deadline: float = 0.0
    """``time.time()`` by which the layout's rounds should be done (``--quick``: from
    :data:`QUICK_TARGET_S`; ``pipeline_model.phase_policy``); 0: every planned round runs."""
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    shares: list[float] = field(default_factory=list)
    splits: dict[str, list[int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ks"] = list(self.ks)
        out["slow_ranks"] = list(self.slow_ranks)
        return out


def phase_plan(quick: bool) -> dict[str, dict[str, int]]:
    """Global round numbers: each phase's first round (warm-up included), rounds, warm-up."""
    # No warm-up round in quick runs: every variant already ran an unrecorded step when it was
    # built (``pipeline_worker._build_set``), which pays its lazy initialisation.
    quick_sizes = {"a": (0, 4), "b": (0, 8), "c": (0, 4)}
    full_sizes = {"a": (1, 8), "b": (0, 16), "c": (1, 8)}
    sizes = quick_sizes if quick else full_sizes
    plan, start = {}, 0
    for name, (warmup, rounds) in sizes.items():
        plan[name] = {"start": start, "rounds": rounds, "warmup": warmup}
        start += warmup + rounds
    return plan


def job_shares(phases: dict[str, dict[str, int]]) -> list[float]:
    """Per global round, the share of the targeted link left to the job (1 outside phase b)."""
    total = sum(p["warmup"] + p["rounds"] for p in phases.values())
    shares = [1.0] * total
    b = phases["b"]
    for i in range(b["rounds"]):
        shares[b["start"] + b["warmup"] + i] = PREEMPT_PATTERN[i % len(PREEMPT_PATTERN)]
    return shares


def planned_splits(layers: int, pp: int, tp: int, slow_ranks: Sequence[int], factor: float) -> dict:
    """Colossal-AI's even split and the planner's splits for equal devices and phase (c)'s.

    ``slow`` here counts device speed alone (every second of a block stretched, the slow
    stage's TP widths uneven in proportion to speed); the ranks replace it with the split the
    plugin plans from measured stage times (``plan.stage_times``) or its trial picks, which
    the result records as ``measured_split``."""
    equal = split_layers(layers, stage_speeds([1.0] * (pp * tp), pp, tp, 1))
    speeds = device_speeds(pp * tp, slow_ranks, factor)
    slow = split_layers(layers, stage_speeds(speeds, pp, tp, 1))
    return {"even": equal, "equal": equal, "slow": slow}


def build_specs(quick: bool, network_mode: str) -> list[BenchSpec]:
    """PP=4 (m=16, micro-batches of 1) and PP=2 x TP=2 (m=8 of 2); tenant into stage 2 / 1;
    phase (c)'s half-speed device: rank 1 (stage 1) / rank 0 (one of stage 0's TP pair)."""
    phases = phase_plan(quick)
    shares = job_shares(phases)
    layouts = [
        ("pp4", 4, 1, 16, 2, 1, (1,), RATE_GBPS),
        ("pp2xtp2", 2, 2, 8, 2, 0, (0,), MIXED_RATE_GBPS),
    ]
    specs = []
    for name, pp, tp, m, target, slow_stage, slow_ranks, rate in layouts:
        spec = BenchSpec(
            name=name,
            pp=pp,
            tp=tp,
            m=m,
            target_rank=target,
            slow_stage=slow_stage,
            slow_ranks=slow_ranks,
            quick=quick,
            budget_microbatches=0.75 * m,
            even_k1=not quick,
            link_shares_variant=not quick and tp > 1,
            rate_gbps=rate,
            network_mode=network_mode,
            phases=phases,
            shares=shares,
        )
        splits = planned_splits(spec.layers, pp, tp, slow_ranks, spec.slow_factor)
        specs.append(BenchSpec(**{**asdict(spec), "splits": splits}))
    return specs


# -- summary (pure) ------------------------------------------------------------------------


def _ratios(num: list[float], den: list[float]) -> list[float]:
    return [a / b for a, b in zip(num, den, strict=True)]


def _interval(ratios: list[float]) -> dict[str, Any]:
    if len(ratios) < 2:
        value = ratios[0] if ratios else float("nan")
        return {"value": value, "ci": [value, value], "rounds": len(ratios)}
    interval = ratio_interval(ratios)
    return {"value": interval.value, "ci": [interval.low, interval.high], "rounds": len(ratios)}


def _preempted_rounds(spec: dict[str, Any], phase: dict[str, Any]) -> list[int]:
    """Indices (within the phase's recorded rounds) of rounds with the tenant on."""
    first = phase["first_round"]
    return [i for i in range(phase["rounds"]) if spec["shares"][first + i] < 1.0]


def _static_names(series: dict[str, list[float]]) -> list[str]:
    """The static-k variants on ada's split (``k1``, ``k2``, ...; not phase (c)'s ``k1_even``)."""
    return sorted({n for n in (key.split(".")[0] for key in series) if re.fullmatch(r"k\d+", n)})


def layout_figures(spec: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """One layout's figures (each a median with its interval) from its worker result."""
    a, b, c = (result["phases"][p]["series"] for p in "abc")
    hit = _preempted_rounds(spec, result["phases"]["b"])
    free_b = [i for i in range(result["phases"]["b"]["rounds"]) if i not in hit]

    def pick(values: list[float], rounds: list[int]) -> list[float]:
        return [values[i] for i in rounds]

    figures: dict[str, Any] = {
        "ada_vs_1f1b_unpreempted": _interval(_ratios(a["stock.step"], a["ada.step"])),
        "ada_vs_1f1b_preempted": _interval(
            _ratios(pick(b["stock.step"], hit), pick(b["ada.step"], hit))
        ),
        "ada_vs_k1_preempted": _interval(
            _ratios(pick(b["k1.step"], hit), pick(b["ada.step"], hit))
        ),
        "planned_vs_even_split_slow_stage": _interval(
            _ratios(c["stock.step"], c["planned_1f1b.step"])
        ),
        # What preemption costs 1F1B (median step, preempted rounds over phase a): a schedule
        # that hides every transfer gains about this much, and no more, over 1F1B in (b).
        "planned_split_slow_stage": result.get("measured_split", {}).get("split"),
        "stock_preemption_cost": statistics.median(pick(b["stock.step"], hit))
        / statistics.median(a["stock.step"]),
    }
    if free_b:  # none when a --quick phase (b) stopped within its first stretch
        figures["ada_vs_1f1b_phase_b_free_rounds"] = _interval(
            _ratios(pick(b["stock.step"], free_b), pick(b["ada.step"], free_b))
        )
    ada = result["ada"]
    budgets = {p: ada["slow" if p == "c" else "equal"]["budget_mib"] * 2**20 for p in "abc"}
    for phase, series, rounds in (("a", a, None), ("b_preempted", b, hit), ("c", c, None)):
        names = _static_names(series)
        # Only the static k whose measured peaks fit ada's budget: the others break the limit
        # ada is held to (reported on their own as ..._any_memory).
        fitting = [n for n in names if _peak(series, n) <= budgets[phase[0]]]
        use = rounds if rounds is not None else list(range(len(series["ada.step"])))
        medians = {n: statistics.median(pick(series[f"{n}.step"], use)) for n in names}
        for suffix, pool in (("", fitting or names), ("_any_memory", names)):
            best = min(pool, key=lambda n: medians[n])
            ratios = _ratios(pick(series[f"{best}.step"], use), pick(series["ada.step"], use))
            figures[f"ada_vs_best_static_k_{phase}{suffix}"] = {**_interval(ratios), "best": best}
    if "ada_link_shares.step" in b:  # full runs with TP (``BenchSpec.link_shares_variant``)
        figures["link_shares_vs_equal_pieces_preempted"] = _interval(
            _ratios(pick(b["ada.step"], hit), pick(b["ada_link_shares.step"], hit))
        )
        figures["link_shares_vs_equal_pieces_unpreempted"] = _interval(
            _ratios(a["ada.step"], a["ada_link_shares.step"])
        )
    if "k1_even.step" in c:  # full runs (``BenchSpec.even_k1``)
        figures["planned_vs_even_split_slow_stage_kfkb_k1"] = _interval(
            _ratios(c["k1_even.step"], c["k1.step"])
        )
    figures["sim_error"] = sim_errors(result)
    figures["memory"] = memory_check(result)
    return figures


def _peak(series: dict[str, list[float]], name: str) -> float:
    """A variant's largest measured stage peak over a phase's rounds (bytes)."""
    return max(max(v) for key, v in series.items() if key.startswith(f"{name}.mem"))


def sim_errors(result: dict[str, Any]) -> dict[str, float]:
    """Median relative error of the simulated execute_pipeline time, per phase and kFkB variant."""
    out = {}
    for phase, data in result["phases"].items():
        series = data["series"]
        for key in series:
            if key.endswith(".sim"):
                name = key[: -len(".sim")]
                errors = [
                    abs(s - p) / p for s, p in zip(series[key], series[f"{name}.meas"], strict=True)
                ]
                out[f"{phase}.{name}"] = statistics.median(errors)
    return out


def memory_check(result: dict[str, Any]) -> dict[str, Any]:
    """ada's largest measured stage peak per phase against its budget (bytes)."""
    out: dict[str, Any] = {"exceeded": False}
    for phase, data in result["phases"].items():
        split = "slow" if phase == "c" else "equal"
        budget = result["ada"][split]["budget_mib"] * 2**20
        series = data["series"]
        peaks = [max(series[key]) for key in series if key.startswith("ada.mem")]
        out[phase] = {"peak_bytes": max(peaks), "budget_bytes": budget}
        out["exceeded"] = out["exceeded"] or max(peaks) > budget
    return out


def summarise(network_mode: str, layouts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's summary keys from every layout's figures (the worst layout for each)."""

    def worst(key: str) -> float:
        return min(f[key]["value"] for f in layouts.values())

    static = [
        f[key]["value"]
        for f in layouts.values()
        for key in f
        if key.startswith("ada_vs_best") and not key.endswith("_any_memory")
    ]
    summary = {
        "network_mode": network_mode,
        "ada_vs_1f1b_preempted": worst("ada_vs_1f1b_preempted"),
        "ada_vs_1f1b_unpreempted": worst("ada_vs_1f1b_unpreempted"),
        "ada_vs_best_static_k": min(static),
        "planned_vs_even_split_slow_stage": worst("planned_vs_even_split_slow_stage"),
        "sim_max_error": max(e for f in layouts.values() for e in f["sim_error"].values()),
        "memory_limit_exceeded": any(f["memory"]["exceeded"] for f in layouts.values()),
    }
    extra = "planned_vs_even_split_slow_stage_kfkb_k1"
    if all(extra in f for f in layouts.values()):  # full runs only (``BenchSpec.even_k1``)
        summary[extra] = worst(extra)
    return summary


# -- running -------------------------------------------------------------------------------


def layout_deadline(now: float, run_deadline: float, name: str, left: Sequence[str]) -> float:
    """When layout ``name`` should be done: its share (:data:`LAYOUT_SHARES`) among the layouts
    ``left`` to run (itself included) of the time from ``now`` to ``run_deadline``."""
    share = LAYOUT_SHARES[name] / sum(LAYOUT_SHARES[n] for n in left)
    return now + max(0.0, run_deadline - now) * share


def network_mode(asked: str | None) -> tuple[str, str]:
    """The links to run on and, when falling back to the model, why: ``asked`` "model" or
    "shaped" (``--network``), None for shaped links where they can be built.

    Raises ConfigError when shaped links are asked for and cannot be built (with why)."""
    from colossal_hetero.config import ConfigError
    from colossal_hetero.emulation.shaped.netns import check_shaped_support

    if asked == "model":
        return "model", ""
    try:
        check_shaped_support()
    except ConfigError as error:
        if asked == "shaped":
            raise ConfigError(f"--network shaped: {error}") from None
        return "model", str(error)
    return "shaped", ""


def _network_note(mode: str, why: str) -> str:
    """What the report says of its links."""
    if mode == "shaped":
        return "real tc-shaped links; tenant preemptions are real TCP traffic"
    return f"network model: {why}" if why else "network model, asked for (--network model)"


def selected_layouts(specs: list[BenchSpec], only: str) -> list[BenchSpec]:
    """``specs`` named in ``only`` (``LAYOUTS_ENV``'s value; empty: all of them)."""
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(names) - {spec.name for spec in specs})
    if unknown:
        known = ", ".join(spec.name for spec in specs)
        raise ValueError(f"{LAYOUTS_ENV}: unknown layout(s) {', '.join(unknown)} (known: {known})")
    return [spec for spec in specs if not names or spec.name in names]


def run_layout(spec: BenchSpec) -> dict[str, Any]:
    """One launch of 4 ranks; rank 0's result (every rank's is the same)."""
    from colossal_hetero.bench.pipeline_model import network_config
    from colossal_hetero.bench.pipeline_worker import run_pipeline_worker
    from colossal_hetero.bench.shaped_spawn import run_bench_ranks

    data = spec.to_dict()
    network = None
    if spec.network_mode == "shaped":
        network = replace(
            network_config(data, "shaped"), preemptions=preemptions(spec.shares, spec.target_rank)
        )
    results = run_bench_ranks(
        run_pipeline_worker, WORLD, network=network, timeout_s=SHAPED_TIMEOUT_S, spec=data
    )
    return results[0]  # type: ignore[no-any-return]


def layout_timings(result: dict[str, Any], launched: float, ended: float) -> dict[str, float]:
    """Where one layout's wall time went (seconds): ``launch_s`` (namespaces, links, the ranks'
    imports and process group, up to the worker's start), the worker's set-up parts, each
    phase's rounds, and ``exit_s`` (closing the plugins, leaving, taking the links down).
    ``time.time()`` on one host: the driver's ``launched`` / ``ended``, rank 0's marks."""
    marks = result.get("timings", {})
    out = {key: value for key, value in marks.items() if key.endswith("_s")}
    if "entered_at" in marks:
        out["launch_s"] = marks["entered_at"] - launched
        out["exit_s"] = ended - marks["left_at"]
    for name, phase in result["phases"].items():
        out[f"phase_{name}_s"] = phase["elapsed_s"]
    return out


def run_pipeline_benchmark(*, quick: bool, json_path: str = "", network: str | None = None) -> int:
    """``colossal-hetero bench pipeline``: print the table, write JSON; 0 when it ran.
    ``network``: see :func:`network_mode`."""
    from rich.console import Console

    from colossal_hetero.bench.pipeline_report import print_report, variant_table

    console = Console()
    started = time.perf_counter()
    load_start = os.getloadavg()[0]  # the machine is shared: say how loaded it was
    mode, why = network_mode(network)
    if why:
        console.print(f"shaped links unavailable ({why}); falling back to the network model")
    layouts: dict[str, Any] = {}
    only = os.environ.get(LAYOUTS_ENV, "")
    specs = selected_layouts(build_specs(quick, mode), only)
    run_deadline = time.time() + QUICK_TARGET_S
    for i, spec in enumerate(specs):
        console.print(f"[bold]bench pipeline[/]: {spec.name} on {WORLD} ranks ({mode} links)")
        t0, launched = time.perf_counter(), time.time()
        if quick:
            left = [s.name for s in specs[i:]]
            spec = replace(spec, deadline=layout_deadline(launched, run_deadline, spec.name, left))
        result = run_layout(spec)
        figures = layout_figures(spec.to_dict(), result)
        layouts[spec.name] = {
            "spec": spec.to_dict(),
            "figures": figures,
            "table": variant_table(spec.to_dict(), result),
            "wall_s": time.perf_counter() - t0,
            "timings": layout_timings(result, launched, time.time()),
            "result": result,
        }
    report: dict[str, Any] = {
        "benchmark": "pipeline",
        "quick": quick,
        "load_average_1m": {"start": load_start, "end": os.getloadavg()[0]},
        "cpu_count": os.cpu_count(),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "network_note": _network_note(mode, why),
        "layouts_only": only,
        "summary": summarise(mode, {n: v["figures"] for n, v in layouts.items()}),
        "layouts": layouts,
    }
    report["wall_time_s"] = time.perf_counter() - started
    print_report(console, report)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        console.print(f"wrote {json_path}")
    return 0
