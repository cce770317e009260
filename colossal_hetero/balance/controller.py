"""The balancer's runtime half: a step-seam controller that agrees, decides and acts.

Every ``every`` steps, in ``on_step_end`` (after ``optimizer.step``, outside the step's
clock), each rank packs its recent compute times into one row; one ``all_gather`` over the
world (balance/agree.py) gives every rank the same matrix; each pipeline stage reads its own
rows, and the pure detector, re-planner and SEMI policy compute the same decision on its
ranks, with no broadcast. The action happens right there, between steps: a width move through
``plugin.resize`` (replan, semi; not with pp > 1), or an in-layer plan (balance/inlayer.py)
attached to every resizable layer by the actuator, or removed when the stragglers recover.
The detector is fed each rank's units of work under the attached plan, so its slowdown stays
the device's. The sequence of collectives depends on the step number alone, never on local
data (a move's and a migration's own collectives follow from agreed inputs).

The work model's fixed fraction starts at ``balancer.fixed_fraction`` and is refitted from
the times before and after each width move. Under semi, an in-layer bridge whose next window
measured a clear loss is taken off for good (``bridge_off``), and an in-layer action with no
net gain is never attached.

Every agreement writes one decision record ``{"step", "controller", "inputs", "decision",
"predicted_gain"}`` to ``balance_rank{r}.jsonl``; the first agreement after a move or an
in-layer change writes the measured gain in its own record.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from colossal_hetero.balance.agree import all_gather_rows
from colossal_hetero.balance.detector import (
    Detection,
    DetectorSettings,
    StragglerDetector,
    fixed_fraction_from_move,
    shares_of,
    work_units,
)
from colossal_hetero.balance.inlayer import (
    InLayerPlan,
    effective_slowdown,
    plan_offloads,
    plan_units,
    predicted_times,
)
from colossal_hetero.balance.recovery import RecoveryWatch, near_empty, seeds_of
from colossal_hetero.balance.replan import (
    ReplanDecision,
    best_plan,
    decide_replan,
    flagged_speeds,
    held_speeds,
    measurable_slowdown,
    off_plan,
    planning_speeds,
)
from colossal_hetero.balance.semi import (
    SemiInputs,
    SemiSettings,
    bridge_pays,
    comm_time,
    decide,
    gains_nothing,
)
from colossal_hetero.balance.window import Agreed, Report, pack
from colossal_hetero.config.schema import BalancerConfig
from colossal_hetero.emulation import StepTiming
from colossal_hetero.metrics.decisions import DecisionWriter, decision_log_path

Widths = dict[str, tuple[int, ...]]
REPLAN_UNAVAILABLE = "replan unavailable: pp > 1"
Outcome = tuple[dict[str, Any], float, Callable[[], None] | None]
"""A decision record's body, its predicted gain (s/step), the action to run after it (or None)."""


def balance_log_path(folder: str | Path, rank: int) -> Path:
    """The decision log of ``rank`` in the metrics folder: ``balance_rank{rank}.jsonl``."""
    return decision_log_path(folder, "balance", rank)


@dataclass(frozen=True)
class Actuator:
    """What the controller acts through (the plugin's parts, as callables)."""

    widths: Callable[[], Widths]
    """The widths running now."""
    plan: Callable[[tuple[float, ...]], Widths] | None
    """The planner's widths for relative speeds per position (None: no re-plan, pp > 1)."""
    resize: Callable[[Widths], None]
    """Move to new widths (``plugin.resize``), called on every rank between steps."""
    ops: Any = None
    """The in-layer actuator (``balance.actuator.LayerOps``: ``plan``, ``apply(plan)``,
    ``clear()``, ``refresh()``); None where no in-layer op runs (detect, replan)."""
    compute: Mapping[str, float] | None = None
    """Per width key, the compute weighing its share (``detector.width_key_compute``; None: 1)."""


@dataclass(frozen=True, slots=True)
class _View:
    """What one agreement decides from."""

    detection: Detection
    agreed: Agreed
    widths: Widths
    shares: tuple[float, ...]
    work: tuple[float, ...]
    """Per position, its units of work under the attached in-layer plan."""
    slowdown: tuple[float, ...]
    """Per position, the slowdown to plan in-layer ops from (``inlayer.effective_slowdown``)."""
    stragglers: tuple[int, ...]
    released: tuple[int, ...] = ()  # near-empty ranks released by a fall of their readings


class BalanceController:
    """Seam controller of every ``balancer.mode`` but none (detect, resize, migrate, replan, semi).

    Args:
        settings: the balancer config.
        tp_size, tp_rank: this rank's tensor-parallel group size and rank in it.
        group_index: an id shared by the ranks of this rank's tensor-parallel group.
        stage: this rank's pipeline stage; each stage agrees and decides on its own rows.
        planned_for: relative speeds per position the current widths were planned with (the
            declared ones; after a re-plan, the planning speeds it handed the planner).
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
        stage: int = 0,
        planned_for: tuple[float, ...],
        weight_bytes: float,
        actuator: Actuator,
        device: torch.device,
        log: DecisionWriter,
    ) -> None:
        self.settings, self.tp_size, self.tp_rank = settings, tp_size, tp_rank
        self.group_index, self.stage, self.planned_for = group_index, stage, planned_for
        self._held: tuple[float, ...] | None = None  # the speeds the widths were planned at
        self._watch = RecoveryWatch()  # readings at these widths (near-empty recoveries)
        self.weight_bytes, self.actuator, self.device = weight_bytes, actuator, device
        detector = DetectorSettings(
            settings.smoothing, settings.threshold, settings.release, settings.stable_tolerance
        )
        self.detector = StragglerDetector(tp_size, detector)
        self.move_cost_s = settings.move_cost_s
        self.log = log
        self.agree_s: list[float] = []
        """Seconds of each agreement's all_gather on this rank (the detector's overhead)."""
        self.detections: list[Detection] = []
        window: list[deque[float]] = [deque(maxlen=settings.window) for _ in range(4)]
        self._compute, self._steps, self._bandwidth, self._allreduce = window
        self._move_s = 0.0
        self._warm = False  # the next step is the first at these widths
        self._pending: tuple[int, float, float] | None = None  # move step, step before, gain
        self._pending_in_layer = False  # whether the pending measurement is of in-layer ops
        self.bridge_off: tuple[int, float] | None = None
        """Under semi, (step, measured gain) of an in-layer plan whose next window measured a clear
        loss (step over 10% slower): its ops come off for the rest of the run (re-plans alone)."""
        self._attached_at = 0  # the step the in-layer plan attached now was last measured raw
        self.fixed_fraction = settings.fixed_fraction
        """The work model's fixed fraction: the config's, then the median of it and each
        move's estimate from measured times (``detector.fixed_fraction_from_move``)."""
        self.ops_fraction = settings.fixed_fraction
        """The work model's fixed fraction under in-layer ops: the part of a rank's compute
        that dropping or migrating its columns does not shrink (its replicated layers, and
        the ops' own index copies, imputation and sends). It starts at the config's; each
        change of the attached plan refits it from the measured times before and after
        (the median of every such estimate), so that a rank's seconds per unit of work stay
        its device's under the ops and a recovery shows in them."""
        self._estimates: dict[str, list[float]] = {"move": [self.fixed_fraction], "ops": []}
        self._moved: tuple[str, tuple[float, ...], tuple[float, ...], set[int]] | None = None
        # ("move" | "ops", scaling shares, per-position times) of the window before the
        # last width move or change of the in-layer plan

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
            stage=self.stage,
        )

    def _agree_and_act(self, step: int) -> None:
        start = time.perf_counter()
        rows = all_gather_rows(pack(self._report(), self.settings.window), None, self.device)
        self.agree_s.append(time.perf_counter() - start)
        if not Agreed.complete(rows, self.tp_size, self.stage):
            return  # a position reported no step yet (warm-up after a move): decide later
        agreed = Agreed.of(rows, self.tp_size, self.stage)
        if min(len(w) for w in agreed.windows) < min(self.settings.window, 2):
            return  # one step since the start or a change is no median: decide later
        self._move_s = 0.0
        if agreed.move_s > 0:  # the last move, as measured (slowest rank)
            self.move_cost_s = agreed.move_s
        widths = self.actuator.widths()
        shares = self._shares(widths)
        self._refine_fixed_fraction(agreed)
        work = plan_units(self.plan, shares, self.phi)
        loaded = set(range(self.tp_size)) - near_empty(shares)  # read against these
        detection = self.detector.update(step, agreed.windows, work, loaded)
        cap = 1 + 2 * self.settings.threshold  # a reading over it is slow whatever the fit
        released = self._watch.update(detection.slowdown, shares, detection.stragglers, cap)
        if released:  # near-empty ranks whose readings fell (balance/recovery.py)
            detection = self.detector.rebase(step, released)
        self.detections.append(detection)
        self._log_measured(step, agreed)
        if self.actuator.ops is not None:
            self.actuator.ops.refresh()  # priority period: local, no communication
        slowdown, stragglers = effective_slowdown(
            self.plan,
            detection.slowdown,
            detection.stragglers,
            agreed.times,
            release=self.settings.release,
            budget=self.settings.accuracy_budget,
        )
        view = _View(detection, agreed, widths, shares, work, slowdown, stragglers, released)
        decision, gain, act = self._decide(step, view)
        self.log.write(
            {
                "step": step,
                "controller": "balance",
                "inputs": {
                    **_inputs(view, self.move_cost_s, self.plan, self.fixed_fraction),
                    "ops_fraction": round(self.ops_fraction, 4),
                },
                "decision": {"mode": self.settings.mode, **decision},
                "predicted_gain": gain,
            }
        )
        if act is not None:
            act()

    @property
    def phi(self) -> float:
        """The fixed fraction of the work model now: ``ops_fraction`` while in-layer ops are
        attached, else ``fixed_fraction``."""
        return self.fixed_fraction if self.plan.empty else self.ops_fraction

    @property
    def plan(self) -> InLayerPlan:
        """The in-layer plan attached now (empty without in-layer ops)."""
        ops = self.actuator.ops
        return ops.plan if ops is not None else InLayerPlan()

    def _decide(self, step: int, view: _View) -> Outcome:
        """The decision record's body, its predicted gain, and what to run after logging."""
        mode = self.settings.mode
        if not self.plan.empty and step - self._attached_at >= self.settings.probe_steps:
            return self._probe(step, view)
        if mode == "detect":
            return {"action": "none", "reason": "detect only"}, 0.0, None
        if mode == "replan":
            return self._replan_outcome(step, view, view.agreed.times)
        if mode in ("resize", "migrate"):
            return self._in_layer(step, view, {r: mode for r in view.stragglers})
        return self._semi(step, view)

    def _semi(self, step: int, view: _View) -> Outcome:
        """SEMI on the times the ranks would take without in-layer ops (the slowdown to plan
        from times the fastest unloaded rank's seconds per unit of work, times their units
        at these widths), so that balanced ops do not hide the straggler they balance."""
        base = work_units(view.shares, self.fixed_fraction)
        free = [
            t / max(w, 1e-12)
            for r, (t, w) in enumerate(zip(view.agreed.times, view.work, strict=True))
            if self.plan.of(r) is None
        ]
        unit = min(free) if free else min(view.agreed.times)
        times = tuple(unit * s * b for s, b in zip(view.slowdown, base, strict=True))
        semi = decide(self._semi_inputs(view.agreed, view.widths, times), self._semi_settings())
        extra: dict[str, Any] = {"semi": asdict(semi)}
        if self.actuator.plan is None:  # pp > 1: the in-layer actions only
            extra["replan"] = REPLAN_UNAVAILABLE
        # Without a bridge (bridge_off), a re-plan that pays is the only action left.
        bridgeless = self.bridge_off is not None and semi.replan_value > 0
        # No op running and none to pick (no rank flagged, or widths that even the times):
        # re-plan as mode replan would where the widths were planned for other speeds.
        idle = self.plan.empty and (not view.stragglers or semi.action == "none")
        tried = semi.action == "replan" or bridgeless or idle
        if tried:
            decision, gain, act = self._replan_outcome(step, view, times)
            if act is not None:
                return {**decision, **extra, "executed": "replan"}, gain, act
            extra["replan_waits"] = decision["reason"]
            settings = self.settings
            waits = settings.stable_steps - view.detection.stable_for()
            if not bridge_pays(
                waits, semi, settings.every, settings.window, settings.horizon_steps
            ):
                extra["bridge_skipped"] = "the re-plan comes sooner without it"
                return {"action": "keep", **extra, "executed": "none"}, 0.0, None
        picks = {c.rank: c.action for c in semi.choices}
        # A straggler whose best in-layer action gains nothing net of its accuracy cost (or
        # of migration's messages) gets none: semi then waits for the re-plan.
        worthless = {c.rank for c in semi.choices if gains_nothing(c, times)}
        current = self.plan.actions()
        actions = {}
        for rank in view.stragglers:  # the detector's hysteresis decides who
            action = picks.get(rank, current.get(rank))
            if action is not None and rank not in worthless:
                actions[rank] = action
        if self.bridge_off is not None:  # the ops measured a loss here: no bridge, ops off
            extra["bridge_off"] = {"step": self.bridge_off[0], "measured": self.bridge_off[1]}
            actions = {}
        decision, gain, act = self._in_layer(step, view, actions)
        if act is None and self.plan.empty and not tried:  # no op pays: a re-plan may
            replan, gain, act = self._replan_outcome(step, view, times)
            if act is not None:
                return {**replan, **extra, "in_layer": decision, "executed": "replan"}, gain, act
        return {**decision, **extra, "executed": decision["action"]}, gain, act

    def _in_layer(self, step: int, view: _View, actions: dict[int, str]) -> Outcome:
        """Attach the in-layer plan for ``actions`` unless it matches the attached one (within
        ``stable_tolerance``) or, under semi, it predicts no gain (removing ops always runs;
        modes resize and migrate act on every flagged straggler, the gain only logged)."""
        settings, now = self.settings, self.plan
        if self.actuator.ops is None:
            return {"action": "none", "reason": "no in-layer ops in this model"}, 0.0, None
        new = plan_offloads(
            actions,
            view.slowdown,
            view.shares,
            fixed_fraction=self.ops_fraction,
            budget=settings.accuracy_budget,
        )
        if new.same_as(now, settings.stable_tolerance):
            why = "no straggler" if new.empty else "ops attached for these slowdowns"
            return {"action": "none" if new.empty else "keep", "reason": why}, 0.0, None
        times = view.agreed.times
        predicted = predicted_times(times, now, new, view.shares, self.ops_fraction)
        inputs = self._semi_inputs(view.agreed, view.widths, times)
        comm = sum(comm_time(o.migrated, o.rank, inputs) for o in new.migrating)
        gain = max(times) - max(predicted) - comm
        body = {
            "action": "in_layer",
            **new.record(),
            "predicted_times": [round(t, 6) for t in predicted],
            "predicted_comm_s": comm,
        }
        if new.empty:
            return (
                {**body, "reason": "stragglers recovered: ops removed"},
                gain,
                self._attacher(step, new, view.agreed, gain),
            )
        if gain <= 0 and settings.mode == "semi":  # resize / migrate: the user's choice
            return {"action": "keep", "reason": f"predicted gain {gain:.4g} s <= 0"}, gain, None
        why = f"predicted {gain:.4g} s/step saved"
        return {**body, "reason": why}, gain, self._attacher(step, new, view.agreed, gain)

    def _attacher(
        self, step: int, plan: InLayerPlan, agreed: Agreed, gain: float
    ) -> Callable[[], None]:
        def attach() -> None:
            assert self.actuator.ops is not None
            if self.plan.empty:
                self._attached_at = step
            self._mark_change("ops", agreed)
            self.actuator.ops.apply(plan)
            self._restart_window()
            self._pending = (step, agreed.step_time, gain)
            self._pending_in_layer = not plan.empty

        return attach

    def _probe(self, step: int, view: _View) -> Outcome:
        """Take the in-layer ops off for one agreement window: the ops' own overheads (sends,
        index copies) can hide a recovery from the measured times, so every ``probe_steps``
        the stragglers' raw slowdown is measured again (the detector restarts its smoothing,
        flags kept) and the next agreement plans from it."""
        plan = self.plan

        def probe() -> None:
            assert self.actuator.ops is not None
            self._mark_change("ops", view.agreed)
            self.actuator.ops.clear()
            self.detector.reset(step)
            self._restart_window()

        body = {"action": "probe", **plan.record(), "reason": f"ops off to re-measure ({step})"}
        return body, 0.0, probe

    def _replan_outcome(self, step: int, view: _View, times: tuple[float, ...]) -> Outcome:
        decision = self._replan(view.detection, times, view.widths)
        body = {**asdict(decision)}
        if decision.action != "resize":
            return body, decision.predicted_gain, None
        return body, decision.predicted_gain, lambda: self._move(step, decision, view.agreed)

    def _replan(
        self, detection: Detection, times: tuple[float, ...], widths: Widths
    ) -> ReplanDecision:
        """Re-plan at the flagged speeds once stable ``stable_steps`` (at once for a sudden
        straggler, ``_sudden``) and moved off those the widths were planned for (replan.py)."""
        settings, shares = self.settings, self._shares(widths)
        if self.actuator.plan is None:
            return ReplanDecision("none", widths, 0.0, REPLAN_UNAVAILABLE)
        slowdown = measurable_slowdown(detection.slowdown, shares)
        if detection.stable_for() < settings.stable_steps and not self._sudden(detection):
            why = f"stable for {detection.stable_for()} < stable_steps {settings.stable_steps}"
            return ReplanDecision("none", widths, 0.0, why)
        speeds = flagged_speeds(slowdown, detection.stragglers)
        speeds = held_speeds(speeds, self._held, shares, detection.stragglers)
        target = planning_speeds(speeds, self.fixed_fraction)
        if not off_plan(target, self.planned_for, settings.stable_tolerance):
            return ReplanDecision("none", widths, 0.0, "widths already planned for these speeds")
        start = time.perf_counter()
        try:
            compute = self.actuator.compute
            planned, target = best_plan(self.actuator.plan, speeds, self.fixed_fraction, compute)
        except ValueError as error:  # infeasible at these speeds: keep running as is
            return ReplanDecision("none", widths, 0.0, f"planner: {error}")
        planning_s = time.perf_counter() - start
        decision = decide_replan(
            times,
            widths,
            planned,
            horizon_steps=settings.horizon_steps,
            move_cost_s=self.move_cost_s,
            fixed_fraction=self.fixed_fraction,
            compute=self.actuator.compute,
        )
        # The planner keeping these widths, or a move made: the widths now stand for these
        # speeds. A move that did not pay yet is considered again at the next agreement.
        if decision.action == "resize" or decision.widths == planned:
            self.planned_for, self._held = target, speeds
        if decision.action == "resize":  # a move's cost is the planner's time and the resize
            self._move_s += planning_s
            new_shares = self._shares(decision.widths)
            self._watch.restart(seeds_of(speeds, new_shares, detection.stragglers))
        return decision

    def _shares(self, widths: Mapping[str, tuple[int, ...]]) -> tuple[float, ...]:
        """Per position, its share of the work at ``widths``, keys weighted by compute."""
        return shares_of(widths, self.tp_size, self.actuator.compute)

    def _sudden(self, detection: Detection) -> bool:
        """Whether a rank flagged at this agreement, not at the one before, reads over
        ``1 + 2 * threshold``, or a rank released at it reads under ``1 / (1 + 2 * threshold)``
        of its slowdown before: a change that large is no timing noise, and its first reading
        is near its size, so the re-plan need not wait for ``stable_steps``."""
        last = self.detections[-2] if len(self.detections) > 1 else None
        before = set(last.stragglers) if last is not None else set()
        limit, now = 1 + 2 * self.settings.threshold, detection.slowdown
        gone = before - set(detection.stragglers)
        recovered = any(last.slowdown[r] > limit * now[r] for r in gone) if last else False
        return any(now[r] > limit for r in set(detection.stragglers) - before) or recovered

    def _restart_window(self) -> None:
        """Forget the recent steps (they ran another layout) and skip the next (warm-up)."""
        for buffer in (self._compute, self._steps, self._bandwidth, self._allreduce):
            buffer.clear()
        self._warm = False

    def _move(self, step: int, decision: ReplanDecision, agreed: Agreed) -> None:
        start = time.perf_counter()
        self._mark_change("move", agreed)
        if self.actuator.ops is not None:
            self.actuator.ops.clear()  # the ops' columns belong to the old widths
        self.actuator.resize(decision.widths)
        self._move_s += time.perf_counter() - start
        self.detector.reset(step)  # shares changed: per-unit times start afresh
        self._restart_window()
        self._pending = (step, agreed.step_time, decision.predicted_gain)
        self._pending_in_layer = False

    def _scaling(self) -> tuple[float, ...]:
        """Per position, its scaling work as a share: its GEMM units under the attached plan
        (what it drops or migrates off, what it takes on as a helper) over the group size."""
        shares = self._shares(self.actuator.widths())
        return tuple(u / self.tp_size for u in plan_units(self.plan, shares, 0.0))

    def _mark_change(self, kind: str, agreed: Agreed) -> None:
        """Before a width move (``kind`` "move") or a change of the in-layer plan ("ops"):
        keep the scaling shares, times and offloading ranks, for ``_refine_fixed_fraction``."""
        self._moved = (kind, self._scaling(), agreed.times, {o.rank for o in self.plan.offloads})
        if kind == "ops":  # other work per rank: readings start afresh (a move seeds them)
            self._watch.restart()

    def _refine_fixed_fraction(self, agreed: Agreed) -> None:
        """At the first agreement after a move or a change of the in-layer plan (its windows
        hold two steps or more: ``_agree_and_act`` decides nothing from one), estimate the
        fixed fraction from the times before and after it (none where a rank changed speed
        by over ``1 + 2 threshold``). A move sets ``fixed_fraction`` to the median of the
        configured one and every move's estimate (before session 10, the mean of the old
        value and the estimate: one contaminated window read 0.06 and halved it); an in-layer
        change sets ``ops_fraction`` to the median of every estimate so far, from the
        offloading ranks' times alone (a helper's carry the ops' own costs)."""
        if self._moved is None:
            return
        kind, old_scaling, before, offloading = self._moved
        self._moved = None
        after, steady, scaling = agreed.times, 1 + 2 * self.settings.threshold, self._scaling()
        # A rank near no work on either side of a move runs its fixed part alone there, and a
        # speed change of its hides in it (a recovery mid-window read phi 0.06 in a quiet s9 run).
        only = set(range(self.tp_size)) - near_empty(old_scaling) - near_empty(scaling)
        if kind != "move":
            only = offloading | {o.rank for o in self.plan.offloads}
        estimate = fixed_fraction_from_move(before, old_scaling, after, scaling, steady, only)
        if estimate is None:
            return
        self._estimates[kind].append(estimate)
        if kind == "move":
            self.fixed_fraction = statistics.median(self._estimates[kind])
        else:
            self.ops_fraction = statistics.median(self._estimates[kind])

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
        # A clear loss (10% of the step; the window before can hold a few pre-change steps).
        loss = agreed.step_time - before > 0.1 * before
        if self._pending_in_layer and loss and self.bridge_off is None:
            self.bridge_off = (step, before - agreed.step_time)

    def _semi_inputs(self, agreed: Agreed, widths: Widths, times: tuple[float, ...]) -> SemiInputs:
        return SemiInputs.of(agreed.positions, agreed.bandwidth, self._shares(widths), times)

    def _semi_settings(self) -> SemiSettings:
        return SemiSettings.of(self.settings, self.move_cost_s, self.actuator.plan is not None)


def _inputs(
    view: _View, move_cost_s: float, plan: InLayerPlan, fixed_fraction: float
) -> dict[str, Any]:
    detection, agreed, widths = view.detection, view.agreed, view.widths
    return {
        "attached": plan.record(),
        "slowdown": [round(s, 4) for s in detection.slowdown],
        "planned_slowdown": [round(s, 4) for s in view.slowdown],
        "stragglers": list(detection.stragglers),
        "stable_for": detection.stable_for(),
        "times": [round(t, 6) for t in agreed.times],
        "groups": {str(k): v for k, v in agreed.groups().items()},
        "step_time": round(agreed.step_time, 6),
        "bandwidth": agreed.bandwidth,
        "widths": {k: list(v) for k, v in widths.items()},
        "move_cost_s": move_cost_s,
        "fixed_fraction": round(fixed_fraction, 4),
        "recovered": list(view.released),
    }
