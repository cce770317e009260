"""The balancer's runtime half: a step-seam controller that agrees, decides and acts.

Every ``every`` steps, in ``on_step_end`` (after ``optimizer.step``, outside the step's
clock), each rank packs its recent compute times into one row; one ``all_gather`` over the
world (balance/agree.py) gives every rank the same matrix; the pure detector
(balance/detector.py), re-planner (balance/replan.py) and SEMI policy (balance/semi.py) then
compute the same decision on every rank, with no broadcast of decisions. A resize happens
right there, between steps, through ``plugin.resize``. The sequence of collectives depends on
the step number alone, never on local data (a move's own collectives follow from agreed
inputs, identical everywhere).

Every agreement writes one decision record ``{"step", "controller", "inputs", "decision",
"predicted_gain"}`` to ``balance_rank{r}.jsonl`` beside the per-step metrics; the first
agreement after a move writes the measured gain in its own record.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from colossal_hetero.balance.agree import all_gather_rows
from colossal_hetero.balance.detector import (
    Detection,
    DetectorSettings,
    StragglerDetector,
    shares_of,
    work_units,
)
from colossal_hetero.balance.replan import ReplanDecision, decide_replan
from colossal_hetero.balance.semi import SemiInputs, SemiSettings, decide, executable
from colossal_hetero.balance.window import Agreed, Report, pack
from colossal_hetero.config.schema import BalancerConfig
from colossal_hetero.emulation import StepTiming
from colossal_hetero.metrics.decisions import DecisionWriter, decision_log_path

Widths = dict[str, tuple[int, ...]]
EXECUTABLE = frozenset({"none", "replan"})
"""SEMI actions the runtime can execute today (the in-layer ops are not built)."""


def balance_log_path(folder: str | Path, rank: int) -> Path:
    """The decision log of ``rank`` in the metrics folder: ``balance_rank{rank}.jsonl``."""
    return decision_log_path(folder, "balance", rank)


@dataclass(frozen=True)
class Actuator:
    """What the controller acts through (the plugin's parts, as callables)."""

    widths: Callable[[], Widths]
    """The widths running now."""
    plan: Callable[[tuple[float, ...]], Widths]
    """The planner's widths for relative speeds per tensor-parallel position."""
    resize: Callable[[Widths], None]
    """Move to new widths (``plugin.resize``), called on every rank between steps."""


class BalanceController:
    """Seam controller of ``balancer.mode`` detect, replan or semi.

    Args:
        settings: the balancer config.
        tp_size, tp_rank: this rank's tensor-parallel group size and rank in it.
        group_index: an id shared by the ranks of this rank's tensor-parallel group.
        planned_for: relative speeds per position the current widths were planned for.
        weight_bytes: bytes of this rank's tensor-parallel weight shards.
        actuator: widths, planner and resize.
        device: where the gather's tensor lives (the process group's device).
        log: the decision log.
    """

    def __init__(
        self,
        settings: BalancerConfig,
        *,
        tp_size: int,
        tp_rank: int,
        group_index: int,
        planned_for: tuple[float, ...],
        weight_bytes: float,
        actuator: Actuator,
        device: torch.device,
        log: DecisionWriter,
    ) -> None:
        self.settings, self.tp_size, self.tp_rank = settings, tp_size, tp_rank
        self.group_index, self.planned_for = group_index, planned_for
        self.weight_bytes, self.actuator, self.device, self.log = (
            weight_bytes,
            actuator,
            device,
            log,
        )
        detector = DetectorSettings(
            settings.smoothing, settings.threshold, settings.release, settings.stable_tolerance
        )
        self.detector = StragglerDetector(tp_size, detector)
        self.move_cost_s = settings.move_cost_s
        self.agree_s: list[float] = []
        """Seconds of each agreement's all_gather on this rank (the detector's overhead)."""
        self.detections: list[Detection] = []
        self._compute: deque[float] = deque(maxlen=settings.window)
        self._steps: deque[float] = deque(maxlen=settings.window)
        self._bandwidth: deque[float] = deque(maxlen=settings.window)
        self._allreduce: deque[float] = deque(maxlen=settings.window)
        self._move_s = 0.0
        self._warm = False  # the next step is the first at these widths
        self._pending: tuple[int, float, float] | None = None  # move step, step before, gain

    def on_step_end(self, step: int, timing: StepTiming) -> None:
        """Record the step; every ``every`` steps agree, decide and maybe resize.

        The first step after construction or a move is not recorded: it carries one-off
        costs (autograd and allocator warm-up at new shapes) that are no device's speed.
        """
        if self._warm:
            self._record(timing)
        self._warm = True
        if (step + 1) % self.settings.every == 0:
            self._agree_and_act(step)

    def _record(self, timing: StepTiming) -> None:
        self._compute.append(timing.compute_time)
        self._steps.append(timing.step_time)
        sent, waited = timing.bytes_by_kind["all_reduce"], timing.wait_by_kind["all_reduce"]
        self._allreduce.append(float(sent))
        if waited > 0:
            self._bandwidth.append(sent / waited)

    def close(self) -> None:
        self.log.close()

    def _report(self) -> Report:
        return Report(
            tp_rank=self.tp_rank,
            group=self.group_index,
            compute=tuple(self._compute),
            step_time=statistics.median(self._steps) if self._steps else 0.0,
            bandwidth=statistics.median(self._bandwidth) if self._bandwidth else 0.0,
            move_s=self._move_s,
            weight_bytes=self.weight_bytes,
            allreduce_bytes=statistics.median(self._allreduce) if self._allreduce else 0.0,
        )

    def _agree_and_act(self, step: int) -> None:
        start = time.perf_counter()
        rows = all_gather_rows(pack(self._report(), self.settings.window), None, self.device)
        self.agree_s.append(time.perf_counter() - start)
        if not Agreed.complete(rows, self.tp_size):
            return  # a position reported no step yet (warm-up after a move): decide later
        agreed = Agreed.of(rows, self.tp_size)
        self._move_s = 0.0
        if agreed.move_s > 0:  # the last move, as measured (slowest rank)
            self.move_cost_s = agreed.move_s
        widths = self.actuator.widths()
        work = work_units(shares_of(widths, self.tp_size), self.settings.fixed_fraction)
        detection = self.detector.update(step, agreed.windows, work)
        self.detections.append(detection)
        self._log_measured(step, agreed)
        decision, extra = self._decide(detection, agreed, widths)
        self.log.write(
            {
                "step": step,
                "controller": "balance",
                "inputs": _inputs(detection, agreed, widths, self.move_cost_s),
                "decision": {"mode": self.settings.mode, **asdict(decision), **extra},
                "predicted_gain": decision.predicted_gain,
            }
        )
        if decision.action == "resize":
            self._move(step, decision, agreed)

    def _decide(
        self, detection: Detection, agreed: Agreed, widths: Widths
    ) -> tuple[ReplanDecision, dict[str, Any]]:
        mode = self.settings.mode
        if mode == "detect":
            return ReplanDecision("none", widths, 0.0, "detect only"), {}
        if mode == "replan":
            return self._replan(detection, agreed, widths), {}
        semi = decide(self._semi_inputs(agreed, widths), self._semi_settings())
        run, why = executable(semi, EXECUTABLE)
        extra = {"semi": asdict(semi), "executed": run, "semi_reason": why}
        if run == "replan":
            return self._replan(detection, agreed, widths), extra
        return ReplanDecision("none", widths, 0.0, why), extra

    def _replan(self, detection: Detection, agreed: Agreed, widths: Widths) -> ReplanDecision:
        """Re-plan at the measured speeds once they held ``stable_steps`` and moved away from
        the speeds the current widths were planned for."""
        settings = self.settings
        if detection.stable_for() < settings.stable_steps:
            why = f"stable for {detection.stable_for()} < stable_steps {settings.stable_steps}"
            return ReplanDecision("none", widths, 0.0, why)
        speeds = detection.speeds
        tolerance = settings.stable_tolerance
        if all(abs(a - b) <= tolerance * b for a, b in zip(speeds, self.planned_for, strict=True)):
            return ReplanDecision("none", widths, 0.0, "widths already planned for these speeds")
        start = time.perf_counter()
        try:
            planned = self.actuator.plan(speeds)
        except ValueError as error:  # infeasible at these speeds: keep running as is
            return ReplanDecision("none", widths, 0.0, f"planner: {error}")
        finally:
            self._move_s += time.perf_counter() - start
        self.planned_for = speeds
        return decide_replan(
            agreed.times,
            widths,
            planned,
            horizon_steps=settings.horizon_steps,
            move_cost_s=self.move_cost_s,
            fixed_fraction=settings.fixed_fraction,
        )

    def _move(self, step: int, decision: ReplanDecision, agreed: Agreed) -> None:
        start = time.perf_counter()
        self.actuator.resize(decision.widths)
        self._move_s += time.perf_counter() - start
        self.detector.reset(step)  # shares changed: per-unit times start afresh
        for buffer in (self._compute, self._steps, self._bandwidth, self._allreduce):
            buffer.clear()
        self._warm = False
        self._pending = (step, agreed.step_time, decision.predicted_gain)

    def _log_measured(self, step: int, agreed: Agreed) -> None:
        if self._pending is None:
            return
        moved, before, predicted = self._pending
        self._pending = None
        self.log.write(
            {
                "step": step,
                "controller": "balance",
                "inputs": {
                    "decision_step": moved,
                    "step_time_before": before,
                    "step_time_after": agreed.step_time,
                },
                "decision": {"mode": self.settings.mode, "action": "measured"},
                "predicted_gain": predicted,
                "measured_gain": before - agreed.step_time,
            }
        )

    def _semi_inputs(self, agreed: Agreed, widths: Widths) -> SemiInputs:
        positions = agreed.positions
        return SemiInputs(
            times=agreed.times,
            shares=shares_of(widths, self.tp_size),
            bandwidth=agreed.bandwidth,
            weight_bytes=tuple(r.weight_bytes for r in positions),
            activation_bytes=max(r.allreduce_bytes for r in positions),
        )

    def _semi_settings(self) -> SemiSettings:
        s = self.settings
        return SemiSettings(
            threshold=s.threshold,
            accuracy_budget=s.accuracy_budget,
            accuracy_weight=s.accuracy_weight,
            horizon_steps=s.horizon_steps,
            replan_cost_s=self.move_cost_s,
        )


def _inputs(
    detection: Detection, agreed: Agreed, widths: Widths, move_cost_s: float
) -> dict[str, Any]:
    return {
        "slowdown": [round(s, 4) for s in detection.slowdown],
        "stragglers": list(detection.stragglers),
        "stable_for": detection.stable_for(),
        "times": [round(t, 6) for t in agreed.times],
        "groups": {str(k): v for k, v in agreed.groups().items()},
        "step_time": round(agreed.step_time, 6),
        "bandwidth": agreed.bandwidth,
        "widths": {k: list(v) for k, v in widths.items()},
        "move_cost_s": move_cost_s,
    }
