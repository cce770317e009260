"""``bench dynamic``, the pure part: the phase schedule, the ideal bound, per-phase figures,
detection delays and the JSON summary. No torch, no torch.distributed, no clock.

The throughput run steps every variant once per round, round ``i`` being training step ``i``
of every variant, so that each variant meets the same slowdown at the same step. The
schedule (step numbers are those rounds):

- steps ``[0, warmup)``: warm-up, not measured, at phase 1's speeds;
- phase 1 ``[warmup, warmup + P)``: rank 1 at 1x; phase 2: rank 1 at ``spike``x (4x);
  phase 3: rank 1 back at 1x; rank 3 at ``steady``x (2x) from step 0 to the end.

``ideal = T_u - C_u + C_u * n / sum(speeds)`` per round, from the unperturbed variant's
step time ``T_u`` and mean compute time ``C_u``: compute spread in proportion to the
phase's speeds, communication as measured. ``efficiency = ideal / T``; ``speedup =
T_stock / T``; ``slowdown removed = (T_stock - T) / (T_stock - T_u)``. Each is computed per
round (paired: one round's variants saw the same machine load), and a phase reports the
median over its rounds with a bootstrap interval (``bench.stats``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from colossal_hetero.bench.stats import median_interval, ratio_interval

BALANCED_MODES = ("replan", "resize", "migrate", "semi")
"""Balancer modes whose decisions the benchmark follows (``none`` never decides)."""


@dataclass(frozen=True, slots=True)
class Phase:
    """Steps ``[start, end)`` during which every rank keeps one slowdown factor."""

    name: str
    start: int
    end: int
    factors: tuple[float, ...]
    """Per rank, how many times slower it computes (>= 1)."""

    @property
    def speeds(self) -> tuple[float, ...]:
        """Relative speeds, the fastest rank 1.0."""
        fastest = min(self.factors)
        return tuple(fastest / f for f in self.factors)

    @property
    def stragglers(self) -> tuple[int, ...]:
        """Ranks slower than the fastest."""
        fastest = min(self.factors)
        return tuple(r for r, f in enumerate(self.factors) if f > fastest)

    def steps(self) -> range:
        return range(self.start, self.end)


def three_phases(
    steps_per_phase: int,
    *,
    warmup: int,
    world: int = 4,
    spike_rank: int = 1,
    spike: float = 4.0,
    steady_rank: int = 3,
    steady: float = 2.0,
) -> list[Phase]:
    """The throughput run's schedule (module docstring). Raises ValueError on bad sizes."""
    if steps_per_phase < 2 or warmup < 0:
        raise ValueError(
            f"three_phases: need steps_per_phase >= 2 and warmup >= 0, got "
            f"{steps_per_phase}, {warmup}"
        )
    if not (0 <= spike_rank < world and 0 <= steady_rank < world and spike_rank != steady_rank):
        raise ValueError(f"three_phases: ranks {spike_rank}, {steady_rank} in a world of {world}")
    phases = []
    for index, factor in enumerate((1.0, spike, 1.0)):
        factors = [1.0] * world
        factors[steady_rank] = steady
        factors[spike_rank] = factor
        start = warmup + index * steps_per_phase
        phases.append(Phase(f"phase{index + 1}", start, start + steps_per_phase, tuple(factors)))
    return phases


def middle_half(total_steps: int, *, rank: int, factor: float, world: int = 4) -> list[Phase]:
    """The accuracy run's schedule: ``rank`` at ``factor``x for the middle half of training."""
    if total_steps < 4:
        raise ValueError(f"middle_half: need total_steps >= 4, got {total_steps}")
    quarter = total_steps // 4
    bounds = (0, quarter, total_steps - quarter, total_steps)
    phases = []
    for index, slow in enumerate((1.0, factor, 1.0)):
        factors = tuple(slow if r == rank else 1.0 for r in range(world))
        phases.append(Phase(f"phase{index + 1}", bounds[index], bounds[index + 1], factors))
    return phases


def slowdown_specs(phases: Sequence[Phase], base: float = 1.0) -> list[dict[str, Any]]:
    """``emulation.compute`` entries (``SlowdownSpec`` fields) reproducing ``phases``, every
    factor times ``base`` (every rank's device ``base`` times slower than a core; 1: the
    phases' factors as they are, 1x ranks unslowed).

    Consecutive phases that keep a rank's factor merge into one spec; the first phase starts
    at step 0 (warm-up runs at its speeds) and the last spec of a rank runs to the end.
    """
    specs: list[dict[str, Any]] = []
    world = len(phases[0].factors)
    for rank in range(world):
        runs: list[list[Any]] = []  # [factor, start, end]
        for index, phase in enumerate(phases):
            start = 0 if index == 0 else phase.start
            factor = phase.factors[rank] * base
            if runs and runs[-1][0] == factor:
                runs[-1][2] = phase.end
            else:
                runs.append([factor, start, phase.end])
        for number, (factor, start, end) in enumerate(runs):
            if factor > 1.0:
                last = number == len(runs) - 1
                specs.append(
                    {
                        "rank": rank,
                        "factor": factor,
                        "start_step": start,
                        "end_step": None if last else end,
                    }
                )
    return specs


def ideal_step(
    unperturbed_step: float, unperturbed_compute: float, speeds: Sequence[float]
) -> float:
    """Step time with compute spread in proportion to ``speeds``, communication as measured:
    ``T_u - C_u + C_u * n / sum(speeds)`` (speeds relative to the unperturbed device)."""
    if not speeds or min(speeds) <= 0:
        raise ValueError(f"ideal_step: speeds must be positive, got {list(speeds)}")
    return unperturbed_step - unperturbed_compute + unperturbed_compute * len(speeds) / sum(speeds)


def phase_rounds(phase: Phase, warmup: int) -> slice:
    """The recorded rounds (series positions) of ``phase``: round ``k`` is step ``warmup + k``."""
    return slice(phase.start - warmup, phase.end - warmup)


def phase_figures(
    series: Mapping[str, Sequence[float]],
    phase: Phase,
    *,
    warmup: int,
    variants: Iterable[str],
    reference: str = "unperturbed",
    stock: str = "stock",
) -> dict[str, dict[str, Any]]:
    """Per variant: the phase's median step time and, per round, ideal / efficiency /
    speedup vs stock / slowdown removed (module docstring), each with its 95% interval.

    ``series`` holds ``NAME.step`` (slowest rank's step time) and ``NAME.compute`` (ranks'
    mean compute time) per recorded round, as ``bench.rounds`` names them.
    """
    window = phase_rounds(phase, warmup)
    ref_step = list(series[f"{reference}.step"][window])
    ref_compute = list(series[f"{reference}.compute"][window])
    stock_step = list(series[f"{stock}.step"][window])
    ideal = [ideal_step(t, c, phase.speeds) for t, c in zip(ref_step, ref_compute, strict=True)]
    out: dict[str, dict[str, Any]] = {}
    for name in variants:
        steps = list(series[f"{name}.step"][window])
        row: dict[str, Any] = {"step_time": median_interval(steps).to_dict()}
        row["ideal_step_time"] = median_interval(ideal).to_dict()
        row["efficiency"] = ratio_interval(
            [i / t for i, t in zip(ideal, steps, strict=True)]
        ).to_dict()
        row["speedup_vs_stock"] = ratio_interval(
            [s / t for s, t in zip(stock_step, steps, strict=True)]
        ).to_dict()
        removed = [
            (s - t) / (s - u) if s > u else math.nan
            for s, t, u in zip(stock_step, steps, ref_step, strict=True)
        ]
        finite = [r for r in removed if math.isfinite(r)]
        row["slowdown_removed"] = median_interval(finite).to_dict() if len(finite) >= 2 else None
        out[name] = row
    return out


def detection_delay(
    records: Sequence[Mapping[str, Any]],
    phase: Phase,
    before: Phase | None = None,
    phase_start: int | None = None,
) -> int | None:
    """Steps from the phase's change to the first decision record that reflects it: every
    rank whose factor changed (from ``before``; from all at 1x when None) is flagged exactly
    when it is slower than the fastest in this phase. Counted as that record's step + 1 -
    change (the record follows its step). Ranks whose speed did not change do not count, so
    a noise flag elsewhere does not hide a detection. ``phase_start``: the step of the change
    (default ``phase.start``). None when no record in the phase reflects it.
    """
    change = phase.start if phase_start is None else phase_start
    previous = before.factors if before is not None else (1.0,) * len(phase.factors)
    changed = [r for r, (a, b) in enumerate(zip(previous, phase.factors, strict=True)) if a != b]
    slow = set(phase.stragglers)
    for record in records:
        step = int(record["step"])
        if step < change or step >= phase.end:
            continue
        inputs = record.get("inputs", {})
        if "stragglers" not in inputs:
            continue  # a measured-gain record
        flagged = set(inputs["stragglers"])
        if all((r in flagged) == (r in slow) for r in changed):
            return step + 1 - change
    return None


def action_delay(
    records: Sequence[Mapping[str, Any]], phase: Phase, phase_start: int | None = None
) -> int | None:
    """Like :func:`detection_delay`, to the first record in the phase whose executed action
    changes the layers (anything but none / measured)."""
    change = phase.start if phase_start is None else phase_start
    for record in records:
        step = int(record["step"])
        if change <= step < phase.end and acted(record):
            return step + 1 - change
    return None


def acted(record: Mapping[str, Any]) -> bool:
    """Whether a decision record changed the layers: its ``decision.action`` is none of
    none / keep / measured (a re-plan's move is logged as ``resize``, in-layer ops as
    ``in_layer``)."""
    return record.get("decision", {}).get("action", "none") not in ("none", "keep", "measured")


def moves_in(records: Sequence[Mapping[str, Any]], phase: Phase) -> int:
    """Decision records in ``phase`` that acted (flapping shows as many)."""
    return sum(1 for r in records if phase.start <= int(r["step"]) < phase.end and acted(r))


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """Largest absolute difference of two equally long loss series."""
    if len(a) != len(b) or not a:
        raise ValueError(f"max_abs_diff: series of lengths {len(a)} and {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def relative_increase(value: float, reference: float) -> float:
    """``(value - reference) / reference``."""
    return (value - reference) / reference


def _semi_speedups_in_spike(throughput: Sequence[Mapping[str, Any]]) -> list[float]:
    """semi's speedup over stock in each model's 4x phase (where semi ran)."""
    return [
        t["phases"][t["spike_phase"]]["semi"]["speedup_vs_stock"]["value"]
        for t in throughput
        if "semi" in t["phases"].get(t["spike_phase"], {})
    ]


def _detection_delays(throughput: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[str]]:
    """Every measured detection delay (steps), and ``"model mode phase"`` for each phase
    change that no decision record answered."""
    delays: list[int] = []
    undetected: list[str] = []
    for t in throughput:
        for mode, per_phase in t["delays"].items():
            for phase, delay in per_phase.items():
                if delay is None:
                    undetected.append(f"{t['model']} {mode} {phase}")
                else:
                    delays.append(delay)
    return delays, undetected


def summarise(
    throughput: Sequence[Mapping[str, Any]],
    accuracy: Mapping[str, Any] | None,
    unavailable: Mapping[str, str],
) -> dict[str, Any]:
    """The issue's summary keys from the per-model throughput results and the accuracy run.

    ``throughput[i]``: ``{"model", "phases": {phase: {variant: figures}}, "loss_diff":
    {mode: float}, "val_increase": {mode: float}, "delays": {mode: {phase: int|None}}}``;
    ``accuracy``: ``{"accuracy": {variant: float}}`` or None when not run; ``unavailable``:
    mode -> why it could not run. A key whose inputs are missing is None, with the reason in
    ``summary["reasons"][key]``; no value is ever filled in.
    """
    out: dict[str, Any] = {}
    reasons: dict[str, str] = {}

    def put(key: str, values: list[float], missing: str) -> None:
        out[key] = None
        if values:
            out[key] = values[0]
        else:
            reasons[key] = missing

    def why(mode: str, what: str) -> str:
        return f"{mode} did not run: {unavailable[mode]}" if mode in unavailable else what

    def semi_phase(figure: str, pick: Any) -> list[float]:
        values = [
            p["semi"][figure]["value"]
            for t in throughput
            for p in t["phases"].values()
            if "semi" in p and p["semi"].get(figure) is not None
        ]
        return [pick(values)] if values else []

    put("semi_min_efficiency", semi_phase("efficiency", min), why("semi", "no throughput run"))
    put("semi_min_slowdown_removed", semi_phase("slowdown_removed", min), why("semi", "no run"))
    spike = _semi_speedups_in_spike(throughput)
    put("semi_speedup_in_4x_phase", [min(spike)] if spike else [], why("semi", "no run"))
    for mode in ("migrate", "replan"):
        diffs = [t["loss_diff"][mode] for t in throughput if mode in t["loss_diff"]]
        put(f"{mode}_max_loss_diff", [max(diffs)] if diffs else [], why(mode, "no run"))
    for mode in ("resize", "semi"):
        drops = (accuracy or {}).get("drop_points", {})
        value = [drops[mode]] if mode in drops else []
        put(f"{mode}_digits_accuracy_drop", value, why(mode, "no accuracy run"))
    increases = [t["val_increase"]["semi"] for t in throughput if "semi" in t["val_increase"]]
    put("semi_text_val_loss_increase", [max(increases)] if increases else [], why("semi", "no run"))
    delays, undetected = _detection_delays(throughput)
    if undetected:
        out["max_detection_delay_steps"] = None
        reasons["max_detection_delay_steps"] = "no matching detection in: " + ", ".join(undetected)
    else:
        put("max_detection_delay_steps", [max(delays)] if delays else [], "no balancer ran")
    out["reasons"] = reasons
    out["unavailable_modes"] = dict(unavailable)
    return out


def median(values: Sequence[float]) -> float:
    """Plain median (re-exported for the report)."""
    return statistics.median(values)


def summarise_case(
    model: str,
    result: Mapping[str, Any],
    phases: Sequence[Phase],
    *,
    warmup: int,
    modes: Sequence[str],
) -> dict[str, Any]:
    """One model's throughput figures from its world's result (``run_variants``' form).

    Losses are rank 0's training losses at every step (warm-up included). The lossless
    reference is ``none``: our even TP under the same slowdowns, whose arithmetic is that of
    an unperturbed run (emulation only sleeps); ``loss_diff_vs_stock`` compares with the
    stock unperturbed run as well (different kernels, so not bitwise).
    """
    variants = result["variants"]
    series = result["rounds"]["series"]
    names = list(variants)
    spike = max(phases, key=lambda p: max(p.factors))
    per_phase: dict[str, Any] = {}
    for phase in phases:
        figures = phase_figures(series, phase, warmup=warmup, variants=names)
        for name in names:
            figures[name]["bytes_per_step"] = statistics.median(
                variants[name]["bytes"][phase.start : phase.end]
            )
            figures[name]["moves"] = moves_in(variants[name]["records"], phase)
        per_phase[phase.name] = figures
    losses = {name: [row[3] for row in variants[name]["rows"]] for name in names}
    compared = [m for m in (*modes, "oracle") if m in variants]
    delays, actions = _delays_of(variants, phases, modes)
    return {
        "model": model,
        "compute_fraction": compute_fraction(series),
        "spike_phase": spike.name,
        "phases": per_phase,
        "phase_steps": {p.name: [p.start, p.end] for p in phases},
        "phase_speeds": {p.name: list(p.speeds) for p in phases},
        "loss_diff": {m: max_abs_diff(losses[m], losses["none"]) for m in compared},
        "loss_diff_vs_stock": {m: max_abs_diff(losses[m], losses["unperturbed"]) for m in names},
        "val_losses": {name: variants[name]["evals"] for name in names},
        "val_increase": {
            m: max(
                relative_increase(e[1], r[1])
                for e, r in zip(variants[m]["evals"], variants["none"]["evals"], strict=True)
            )
            for m in compared
        },
        "delays": delays,
        "action_delays": actions,
        "op_bytes": {name: variants[name]["op_bytes"] for name in names},
        "agreement_cost": {m: agreement_cost(variants[m]) for m in modes if m in BALANCED_MODES},
        "widths": {name: variants[name]["widths"] for name in names},
        "oracle_widths": result.get("oracle_widths"),
    }


def compute_fraction(
    series: Mapping[str, Sequence[float]], reference: str = "unperturbed"
) -> float:
    """Median over the recorded rounds of the reference variant's mean compute time over its
    step time: how much of a step the balancers can act on (the rest is collectives)."""
    pairs = zip(series[f"{reference}.compute"], series[f"{reference}.step"], strict=True)
    return statistics.median(c / s for c, s in pairs if s > 0)


def agreement_cost(variant: Mapping[str, Any]) -> dict[str, float] | None:
    """The balancer's agreement seconds against the variant's median step seconds (None
    where none was recorded):

    - ``rank0_per_agreement``: rank 0's median gather over a step. It includes waiting for
      the last rank to finish its step, which the next step's first collective would
      otherwise spend;
    - ``per_agreement``: the median over agreements of the least time any rank spent in the
      gather (the last to arrive waits for the exchange alone), over a step;
    - ``per_step``: that, times agreements per step (the detector's overhead per step).
    """
    seconds = variant.get("agree_s") or []
    if not seconds:
        return None
    step = statistics.median(max(r[0::4]) for r in variant["rows"])
    last = variant.get("agree_last_s") or seconds
    per_agreement = statistics.median(last) / step
    return {
        "rank0_per_agreement": statistics.median(seconds) / step,
        "per_agreement": per_agreement,
        "per_step": per_agreement * len(last) / len(variant["rows"]),
    }


def _delays_of(
    variants: Mapping[str, Any], phases: Sequence[Phase], modes: Sequence[str]
) -> tuple[dict[str, dict[str, int | None]], dict[str, dict[str, int | None]]]:
    """Per balanced mode and phase, the detection delay and the action delay (the first
    phase's change is at step 0, when the steady straggler starts)."""
    delays: dict[str, dict[str, int | None]] = {}
    actions: dict[str, dict[str, int | None]] = {}
    starts = [0] + [p.start for p in phases[1:]]
    befores = [None, *phases[:-1]]
    for mode in (m for m in modes if m in BALANCED_MODES):
        records = variants[mode]["records"]
        delays[mode] = {
            p.name: detection_delay(records, p, b, s)
            for p, b, s in zip(phases, befores, starts, strict=True)
        }
        actions[mode] = {
            p.name: action_delay(records, p, s) for p, s in zip(phases, starts, strict=True)
        }
    return delays, actions
