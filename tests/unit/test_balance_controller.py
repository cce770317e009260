"""The runtime controller without processes: the gather is replaced by synthetic rows of two
ranks whose compute follows the model the controller assumes (phi + (1 - phi) * n * share
units of work at the device's speed), so every decision is determined by hand.

Rank 1 is 4x slow for steps 6..29: the detector flags it, replan moves rank 0 to more work,
and after recovery the controller moves back to the even widths; each move is followed by a
measured-gain record. resize and migrate attach in-layer plans (a fake actuator records
them) with amounts from the agreed slowdown, keep them while it holds, and remove them on
recovery; SEMI executes its own pick."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from colossal_hetero.balance import controller as module
from colossal_hetero.balance.controller import Actuator, BalanceController
from colossal_hetero.balance.detector import (
    DetectorSettings,
    StragglerDetector,
    shares_of,
    work_units,
)
from colossal_hetero.balance.inlayer import InLayerPlan, plan_units
from colossal_hetero.balance.window import HEADER, Report, pack
from colossal_hetero.config.schema import BalancerConfig
from colossal_hetero.emulation import StepTiming
from colossal_hetero.metrics.decisions import DecisionWriter

EVEN = {"ffn": (48, 48)}
SKEW = {"ffn": (84, 12)}
"""The work model's balance at 4x and phi 0.2: 0.2 + 1.6 x 84 / 96 = 4 (0.2 + 1.6 x 12 / 96)
= 1.6 (``replan.best_plan`` re-splits any planner's ffn to it)."""
PHI = 0.2


def _timing(step: int, compute: float) -> StepTiming:
    return StepTiming(step, 2 * compute, compute, compute, 0.0, 0.0)


class _Ops:
    """The in-layer actuator's stand-in: records the plans attached."""

    def __init__(self) -> None:
        self.plan = InLayerPlan()
        self.applied: list[InLayerPlan] = []
        self.refreshes = 0
        self.clears = 0

    def apply(self, plan: InLayerPlan) -> None:
        self.plan = plan
        self.applied.append(plan)

    def clear(self) -> None:
        self.plan = InLayerPlan()
        self.clears += 1

    def refresh(self) -> None:
        self.refreshes += 1


class _Cluster:
    """Two ranks' synthetic compute: ``1 ms * work units * slowdown``, the units under the
    attached in-layer plan."""

    def __init__(self) -> None:
        self.widths: dict[str, tuple[int, ...]] = dict(EVEN)
        self.moves: list[dict] = []
        self.ops = _Ops()

    def slow(self, step: int) -> float:
        return 4.0 if 6 <= step < 30 else 1.0

    def times(self, step: int) -> list[float]:
        units = plan_units(self.ops.plan, shares_of(self.widths, 2), PHI)
        assert self.ops.plan.offloads or units == work_units(shares_of(self.widths, 2), PHI)
        return [1e-3 * units[0], 1e-3 * units[1] * self.slow(step)]

    def plan(self, speeds: tuple[float, ...]) -> dict[str, tuple[int, ...]]:
        return dict(SKEW) if speeds[1] < 0.5 else dict(EVEN)  # the planner's stand-in

    def resize(self, widths: dict) -> None:
        self.moves.append(dict(widths))
        self.widths = dict(widths)


def _controller(
    cluster: _Cluster,
    mode: str,
    monkeypatch: Any,
    move_cost_s: float = 0.01,
    fixed_fraction: float = PHI,
) -> BalanceController:
    settings = BalancerConfig(
        mode=mode,  # type: ignore[arg-type]
        every=3,
        window=3,
        smoothing=1.0,  # no memory: the vector follows each window, so steps are by hand
        stable_steps=3,
        horizon_steps=1000,
        move_cost_s=move_cost_s,
        fixed_fraction=fixed_fraction,
    )
    history: dict[str, list[float]] = {"0": [], "1": []}

    def gather(row: Any, group: Any, device: Any) -> list[list[float]]:
        rows = []
        for rank in (0, 1):
            times = history[str(rank)][-3:]
            report = Report(rank, 0, tuple(times), 2 * max(times), 1e9, row[4], 1e6, 1e5)
            rows.append(pack(report, 3))
        return rows

    monkeypatch.setattr(module, "all_gather_rows", gather)
    controller = BalanceController(
        settings,
        tp_size=2,
        tp_rank=0,
        group_index=0,
        planned_for=(1.0, 1.0),
        weight_bytes=1e6,
        actuator=Actuator(
            lambda: dict(cluster.widths),
            cluster.plan,
            cluster.resize,
            cluster.ops if mode in ("resize", "migrate", "semi") else None,
        ),
        device=torch.device("cpu"),
        log=DecisionWriter(None, "balance", 0),
    )
    controller.history = history  # type: ignore[attr-defined]
    return controller


def _drive(controller: BalanceController, cluster: _Cluster, steps: int) -> None:
    for step in range(steps):
        t0, t1 = cluster.times(step)
        controller.history["0"].append(t0)  # type: ignore[attr-defined]
        controller.history["1"].append(t1)  # type: ignore[attr-defined]
        controller.on_step_end(step, _timing(step, t0))


def test_replan_moves_to_the_fast_rank_and_back(monkeypatch):
    cluster = _Cluster()
    controller = _controller(cluster, "replan", monkeypatch)
    _drive(controller, cluster, 48)
    flagged = [d.step for d in controller.detections if d.stragglers == (1,)]
    assert flagged[0] == 8  # the first window holding slow steps (6, 7, 8)
    records = controller.log.records
    moves = [
        (r["step"], r["decision"]["widths"]) for r in records if r["decision"]["action"] == "resize"
    ]
    # Flagged at 8 at 4x, over 1 + 2 * threshold: a sudden straggler, moved at once;
    # recovered at 30: the window 30..32 reads 1.0 at 32, released from 4.0 (a fall by over
    # 1 + 2 * threshold: a sudden recovery), moved back at once (before session 10: at 35).
    assert moves == [(8, {"ffn": [84, 12]}), (32, {"ffn": [48, 48]})]
    assert cluster.moves == [SKEW, EVEN]
    measured = [r for r in records if r["decision"]["action"] == "measured"]
    assert [r["inputs"]["decision_step"] for r in measured] == [8, 32]
    # Every later window at the skewed widths reads the same speeds: no further move.
    assert all(r["predicted_gain"] > 0 for r in records if r["decision"]["action"] == "resize")
    slow_at_skew = [d for d in controller.detections if 14 <= d.step < 30]
    assert all(d.slowdown == pytest.approx((1.0, 4.0)) for d in slow_at_skew)


def test_a_wrong_fixed_fraction_is_refined_from_each_move(monkeypatch):
    """Configured phi 0 while the cluster's is 0.2: each move's before/after times give 0.2,
    and the controller keeps the median of the configured value and every estimate (0.1 after
    the first move, 0.2 after the second; the mean of old and new before session 10 gave
    0.15), the logged inputs carry it, and the moves are those of the right model."""
    cluster = _Cluster()
    controller = _controller(cluster, "replan", monkeypatch, fixed_fraction=0.0)
    _drive(controller, cluster, 48)
    assert cluster.moves == [SKEW, EVEN]
    assert controller.fixed_fraction == pytest.approx(0.2)
    logged = [
        r["inputs"]["fixed_fraction"] for r in controller.log.records if "slowdown" in r["inputs"]
    ]
    assert logged[0] == 0.0 and logged[-1] == pytest.approx(0.2)
    # After the first move the slowdown at the skewed widths reads nearer the true 4x.
    skew = [d.slowdown[1] for d in controller.detections if 14 <= d.step < 30]
    wrong = work_units(shares_of(SKEW, 2), PHI)[1] / work_units(shares_of(SKEW, 2), 0.0)[1]
    assert all(abs(s - 4.0) < abs(4.0 * wrong - 4.0) for s in skew)


def _in_layer(controller: BalanceController) -> list[tuple[int, list]]:
    return [
        (
            r["step"],
            [
                (o["rank"], o["action"], o["dropped"], o["migrated"])
                for o in r["decision"]["offloads"]
            ],
        )
        for r in controller.log.records
        if r["decision"]["action"] == "in_layer"
    ]


def test_resize_attaches_from_the_slowdown_keeps_and_removes(monkeypatch):
    """Flagged at 8: d = (U - T / s) / G = (1 - 1 / 4) / 0.8 = 0.9375, capped at the budget
    0.5. The detector then reads units 1 - 0.8 * 0.5 = 0.6 at 2.4 ms: still 4x, so the ops
    stay (no flapping); at 32 the window 30..32 reads 1x: ops removed."""
    cluster = _Cluster()
    controller = _controller(cluster, "resize", monkeypatch)
    _drive(controller, cluster, 48)
    assert _in_layer(controller) == [(8, [(1, "resize", 0.5, 0.0)]), (32, [])]
    assert [p.offloads for p in cluster.ops.applied][-1] == ()
    assert cluster.moves == []  # resize never moves widths
    slow = [d for d in controller.detections if 11 <= d.step < 30]
    assert all(d.slowdown == pytest.approx((1.0, 4.0)) and d.stragglers == (1,) for d in slow)
    keeps = [r for r in controller.log.records if r["decision"]["action"] == "keep"]
    assert [r["step"] for r in keeps] == [11, 14, 17, 20, 23, 26, 29]
    measured = [r for r in controller.log.records if r["decision"]["action"] == "measured"]
    assert [r["inputs"]["decision_step"] for r in measured] == [8, 32]
    assert cluster.ops.refreshes == len(controller.detections)
    attach = next(r for r in controller.log.records if r["step"] == 8)
    # predicted: straggler 4 ms -> 4 * 0.6 = 2.4 ms; fast rank 1 ms: 1.6 ms saved
    assert attach["predicted_gain"] == pytest.approx(1.6e-3)


class _WeakOps(_Cluster):
    """In-layer ops that save less than the configured model says: under a plan every rank's
    work follows phi 0.7 (replicated layers and the ops' own copies), not the configured 0.2;
    without ops, phi 0.2 as before."""

    def times(self, step: int) -> list[float]:
        if not self.ops.plan.offloads:
            return super().times(step)
        units = plan_units(self.ops.plan, shares_of(self.widths, 2), 0.7)
        return [1e-3 * units[0], 1e-3 * units[1] * self.slow(step)]


@pytest.mark.parametrize("mode", ["resize", "migrate"])
def test_recovery_under_ops_that_save_less_than_modelled(monkeypatch, mode: str):
    """Attached at 8 from the configured phi 0.2; the agreement at 11 refits the ops' phi from
    the times before and after the attach (exactly 0.7, no noise), so the detector reads the
    device's 4x while the ops run and 1x once rank 1 recovers at 30: the window 30..32 shows
    it at 32 and the ops come off there. With phi 0.2 kept, resize's 0.85 ms at 1x read as
    0.85 / 0.6 = 1.42x and rank 1 stayed flagged until the next probe."""
    cluster = _WeakOps()
    controller = _controller(cluster, mode, monkeypatch)
    _drive(controller, cluster, 48)
    assert controller.ops_fraction == pytest.approx(0.7)
    slow = [d for d in controller.detections if 11 <= d.step < 30]
    assert all(d.slowdown == pytest.approx((1.0, 4.0)) and d.stragglers == (1,) for d in slow)
    after = [d for d in controller.detections if d.step >= 32]
    assert all(d.stragglers == () and d.slowdown == pytest.approx((1.0, 1.0)) for d in after)
    removals = [step for step, offloads in _in_layer(controller) if not offloads]
    assert removals == [32] and cluster.ops.plan.empty
    assert all(step in (8, 11, 14, 32) for step, _ in _in_layer(controller))  # no flapping


class _SpikyWeakOps(_WeakOps):
    """``_WeakOps`` with one 30% spike on rank 1 at step 9, the first step recorded after the
    attach at 7 (under ``every: 2`` step 8 is the skipped warm-up step)."""

    def times(self, step: int) -> list[float]:
        t0, t1 = super().times(step)
        return [t0, t1 * (1.3 if step == 9 else 1.0)]


def test_ops_fraction_waits_for_a_window_of_two_steps(monkeypatch):
    """``every: 2`` (the benchmark's): the agreement at 9 holds one step after the attach at
    7 (the spiked one), so it decides nothing (no record, no refit); the agreement at 11
    refits from the median over steps 9..11, which is clean: phi 0.7 exactly. From step 9
    alone: 0.85 units x 4 x 1.3 = 4.42 ms against 4 ms before, ratio 1.105 for half the GEMM
    units: phi 1.21, clipped to 0.9."""
    cluster = _SpikyWeakOps()
    controller = _controller(cluster, "resize", monkeypatch)
    controller.settings = replace(controller.settings, every=2)
    history: Any = controller.history  # type: ignore[attr-defined]

    def gather(row: Any, group: Any, device: Any) -> list[list[float]]:
        count = sum(1 for v in row[HEADER:] if v == v)  # this rank's recorded steps
        rows = []
        for rank in (0, 1):
            times = history[str(rank)][-count:] if count else []
            report = Report(rank, 0, tuple(times), 2 * max(times, default=0.0), 1e9, 0, 1e6, 1e5)
            rows.append(pack(report, 3))
        return rows

    monkeypatch.setattr(module, "all_gather_rows", gather)
    _drive(controller, cluster, 12)
    assert _in_layer(controller)[0][0] == 7
    assert controller.ops_fraction == pytest.approx(0.7)
    assert [r["step"] for r in controller.log.records if "slowdown" in r["inputs"]] == [3, 5, 7, 11]
    assert len(controller.agree_s) == 6  # every agreement gathered, the first one too


def test_migrate_balances_straggler_and_helper(monkeypatch):
    """One helper: T = (1 + 1 / 1) / (1 + 1 / 4) = 1.6 units, m = (1 - 1.6 / 4) / 0.8 = 0.75:
    both ranks then take 1.6 ms."""
    cluster = _Cluster()
    controller = _controller(cluster, "migrate", monkeypatch)
    _drive(controller, cluster, 48)
    assert _in_layer(controller) == [(8, [(1, "migrate", 0.0, 0.75)]), (32, [])]
    assert cluster.ops.applied[0].helpers == (0,)
    record = next(r for r in controller.log.records if r["step"] == 8)
    assert record["decision"]["predicted_times"] == pytest.approx([1.6e-3, 1.6e-3])
    # While attached both ranks take 1.6 ms, and the detector still reads the device's 4x.
    slow = [d for d in controller.detections if 11 <= d.step < 30]
    assert all(d.slowdown == pytest.approx((1.0, 4.0)) and d.stragglers == (1,) for d in slow)


class _Coarse(_Cluster):
    """A planner whose ffn comes in steps of 16 columns: the balance at 12 is out of reach."""

    def plan(self, speeds: tuple[float, ...]) -> dict[str, tuple[int, ...]]:
        return {"ffn": (80, 16)} if speeds[1] < 0.5 else dict(EVEN)


def test_semi_executes_its_pick(monkeypatch):
    """With a re-plan too costly to pay, SEMI's in-layer pick for rank 1 is what runs; with a
    cheap one the re-plan runs (in-layer ops removed first); a planner in steps of 16 columns
    leaves rank 1 at (0.2 + 0.8 x 2 x 16 / 96) x 4 = 1.87 ms against 0.2 + 0.8 x 2 x 80 / 96
    = 1.53 ms, which SEMI then resizes."""
    cluster = _Cluster()
    controller = _controller(cluster, "semi", monkeypatch, move_cost_s=1e6)
    _drive(controller, cluster, 15)
    picks = [r for r in controller.log.records if r["decision"]["action"] == "in_layer"]
    assert picks and cluster.moves == []
    for record in picks:
        choice = record["decision"]["semi"]["choices"][0]
        assert record["decision"]["offloads"][0]["action"] == choice["action"]
        assert record["decision"]["executed"] == "in_layer"
    cheap = _Coarse()
    controller = _controller(cheap, "semi", monkeypatch)
    _drive(controller, cheap, 15)
    assert cheap.moves == [{"ffn": (80, 16)}]  # flagged at 8 at 4x > 1.3: sudden, re-planned
    replans = [r for r in controller.log.records if r["decision"].get("executed") == "replan"]
    assert [r["step"] for r in replans] == [8]
    assert cheap.ops.clears == 1
    assert [step for step, _ in _in_layer(controller) if step > 8] == [11]


class _CostlyOps(_Cluster):
    """In-layer ops that cost every rank 5 ms per step (as migration's messages can on CPU)."""

    def times(self, step: int) -> list[float]:
        extra = 5e-3 if self.ops.plan.offloads else 0.0
        return [t + extra for t in super().times(step)]


def test_semi_stops_bridging_after_ops_measured_a_loss(monkeypatch):
    """SEMI attaches its in-layer pick (a re-plan does not pay at this move cost); the next
    window's step is slower by far more than 10%, so the controller records the loss, takes
    the ops off and attaches none again; without the cost the ops stay on."""
    cluster = _CostlyOps()
    controller = _controller(cluster, "semi", monkeypatch, move_cost_s=1e6)
    _drive(controller, cluster, 30)
    attached = [p for p in cluster.ops.applied if p.offloads]
    assert len(attached) == 1 and cluster.ops.plan.empty
    assert controller.bridge_off is not None and controller.bridge_off[1] < 0
    later = [r for r in controller.log.records if r["step"] > controller.bridge_off[0]]
    assert later and all("bridge_off" in r["decision"] for r in later if "semi" in r["decision"])
    fine = _Cluster()
    controller = _controller(fine, "semi", monkeypatch, move_cost_s=1e6)
    _drive(controller, fine, 30)
    assert controller.bridge_off is None and not fine.ops.plan.empty


def test_semi_without_a_bridge_re_plans_when_the_move_pays(monkeypatch):
    """The bridge measured a loss; semi's model still prefers in-layer ops (move cost
    1.5 s: a re-plan is worth 0.9 s over the horizon, the ops 1.15 s), but with no bridge left,
    the re-plan, which pays, is what runs."""
    cluster = _CostlyOps()
    controller = _controller(cluster, "semi", monkeypatch, move_cost_s=1e6)
    controller.move_cost_s = 1e6
    _drive(controller, cluster, 12)
    assert controller.bridge_off is not None and cluster.moves == []
    controller.move_cost_s = 1.5  # pays over the horizon, less than the ops are predicted to
    for step in range(12, 30):
        t0, t1 = cluster.times(step)
        controller.history["0"].append(t0)  # type: ignore[attr-defined]
        controller.history["1"].append(t1)  # type: ignore[attr-defined]
        controller.on_step_end(step, _timing(step, t0))
    assert cluster.moves == [SKEW]
    moved = [r for r in controller.log.records if r["decision"].get("executed") == "replan"]
    assert len(moved) == 1 and moved[0]["decision"]["semi"]["action"] == "in_layer"


def test_semi_refines_the_fixed_fraction_from_a_move_made_under_its_ops(monkeypatch):
    """SEMI's re-plan happens with its in-layer ops attached: the times before the move
    followed the ops' GEMM units, and the estimate from them is exact (configured 0, true
    0.2: half-way after the one move)."""
    cluster = _Cluster()
    controller = _controller(cluster, "semi", monkeypatch, fixed_fraction=0.0)
    _drive(controller, cluster, 20)
    assert cluster.moves == [SKEW] and cluster.ops.clears == 1
    assert controller.fixed_fraction == pytest.approx(0.1)


def test_semi_attaches_no_op_that_gains_nothing_net(monkeypatch):
    """Migration priced out (its messages cost more than any gain) and accuracy_weight 1
    (resizing f of the work costs f x t, what it saves): the straggler's best in-layer action
    gains nothing net, so semi, with a re-plan too costly to pay, attaches no op at all (it
    used to attach its pick whatever its gain)."""
    import math

    from colossal_hetero.balance import semi as semi_module

    monkeypatch.setattr(semi_module, "comm_time", lambda *args: math.inf)
    cluster = _Cluster()
    controller = _controller(cluster, "semi", monkeypatch, move_cost_s=1e6)
    controller.settings = replace(controller.settings, accuracy_weight=1.0)
    _drive(controller, cluster, 15)
    semi = [r["decision"]["semi"] for r in controller.log.records if "semi" in r["decision"]]
    choices = [c for s in semi for c in s["choices"]]
    assert choices and all(c["gain"] is None or c["gain"] <= 0 for c in choices)  # None: -inf
    assert cluster.ops.applied == [] and cluster.moves == []


def test_semi_re_plans_when_its_in_layer_pick_would_not_run(monkeypatch):
    """The policy prefers the in-layer plan (forced here: its model and the ops' predicted
    times can disagree, as in a session-9 run where Llama's recovered phase kept the
    4x-phase widths for 6 of its 10 steps), but no op gains anything net (migration priced
    out, accuracy_weight 1), so none runs: semi then re-plans when the move pays, as mode
    replan does. It used to keep the widths."""
    import math

    from colossal_hetero.balance import controller as controller_module
    from colossal_hetero.balance import semi as semi_module

    monkeypatch.setattr(semi_module, "comm_time", lambda *args: math.inf)
    real = controller_module.decide

    def in_layer(inputs, settings):  # type: ignore[no-untyped-def]
        return replace(real(inputs, settings), action="in_layer")

    monkeypatch.setattr(controller_module, "decide", in_layer)
    cluster = _Cluster()
    controller = _controller(cluster, "semi", monkeypatch)
    controller.settings = replace(controller.settings, accuracy_weight=1.0)
    _drive(controller, cluster, 15)
    assert cluster.ops.applied == [] and cluster.moves == [SKEW]
    moved = [r for r in controller.log.records if r["decision"].get("executed") == "replan"]
    assert moved[0]["decision"]["in_layer"]["action"] in ("none", "keep")  # no op ran


def test_semi_skips_a_bridge_that_would_delay_its_re_plan(monkeypatch):
    """Agreements every 2 steps over windows of 3, stable_steps 2 (the benchmark's): rank 1
    is flagged at 7 (window 5..7, median 4x) and the re-plan waits 2 steps. A bridge attached
    at 7 would run one recorded step and leave step 9 a one-step window that decides nothing
    (re-plan at 11); it saves less per step than the re-plan, so semi attaches nothing and
    re-plans at 9. (This test's gather hands over the last 3 steps whatever the controller
    restarted, so without the check it also re-plans at 9, after attaching the bridge.)"""
    cluster = _Cluster()
    controller = _controller(cluster, "semi", monkeypatch)
    # threshold 1.6: the 4x rank is flagged (> 2.6) but not sudden (< 1 + 2 * 1.6)
    controller.settings = replace(controller.settings, every=2, stable_steps=2, threshold=1.6)
    controller.detector = StragglerDetector(2, DetectorSettings(1.0, 1.6, 0.5, 0.1))
    _drive(controller, cluster, 12)
    assert cluster.moves == [SKEW]
    replans = [r for r in controller.log.records if r["decision"].get("executed") == "replan"]
    assert [r["step"] for r in replans] == [9]
    assert not [p for p in cluster.ops.applied if p.offloads]
    skipped = next(r for r in controller.log.records if r["step"] == 7)
    assert "bridge_skipped" in skipped["decision"] and skipped["decision"]["action"] == "keep"


def test_a_sudden_straggler_is_re_planned_at_once_a_mild_one_waits(monkeypatch):
    """Rank 1 at 4x from step 6 (threshold 0.15): flagged at 8 reading 4.0 > 1.3, moved at 8.
    At 1.25x (flagged, under 1.3) it waits stable_steps: flagged at 8, moved at 11."""
    cluster = _Cluster()
    controller = _controller(cluster, "replan", monkeypatch)
    _drive(controller, cluster, 12)
    assert [r["step"] for r in controller.log.records if r["decision"]["action"] == "resize"] == [8]

    class _Mild(_Cluster):
        def slow(self, step: int) -> float:
            return 1.25 if 6 <= step < 30 else 1.0

        def plan(self, speeds: tuple[float, ...]) -> dict[str, tuple[int, ...]]:
            return {"ffn": (52, 44)} if speeds[1] < 0.9 else dict(EVEN)

    mild = _Mild()
    controller = _controller(mild, "replan", monkeypatch)
    _drive(controller, mild, 12)
    assert [d.step for d in controller.detections if d.stragglers == (1,)][0] == 8
    assert [r["step"] for r in controller.log.records if r["decision"]["action"] == "resize"] == [
        11
    ]


class _Proportional(_Cluster):
    """The planner's stand-in splits ffn in proportion to the speeds it is handed."""

    def plan(self, speeds: tuple[float, ...]) -> dict[str, tuple[int, ...]]:
        first = round(96 * speeds[0] / sum(speeds))
        return {"ffn": (first, 96 - first)}


def test_semi_re_plans_when_the_refitted_fraction_moves_the_plan(monkeypatch):
    """Configured phi 0.1, the cluster's 0.2, threshold 0.3 (the benchmark's): the move at 8
    (planning speeds (1, 0.2), ffn (80, 16)) leaves rank 1 at 1.87 ms against 1.53 ms, 1.22x,
    under the threshold, so SEMI sees no straggler in the times. The first window after the
    move refits phi to 0.15: rank 1 reads 1.867 / 0.433 units against 1.533 / 1.567, 4.4x,
    planning speeds (1, 0.148), off the plan's 0.2 by over stable_tolerance. semi re-plans to
    (84, 12) as mode replan does, where both ranks take 1.6 ms (the cluster's balance:
    0.2 + 0.8 x 2 x 84/96 = 4 x (0.2 + 0.8 x 2 x 12/96)). Before session 9 semi kept the
    widths ("no straggler")."""
    moves = {}
    for mode in ("replan", "semi"):
        cluster = _Proportional()
        controller = _controller(cluster, mode, monkeypatch, fixed_fraction=0.1)
        controller.settings = replace(controller.settings, threshold=0.3, release=0.1)
        controller.detector = StragglerDetector(2, DetectorSettings(1.0, 0.3, 0.1, 0.1))
        _drive(controller, cluster, 29)
        moves[mode] = cluster.moves
        assert controller.fixed_fraction == pytest.approx(0.15)
    assert moves["semi"] == moves["replan"] == [{"ffn": (80, 16)}, {"ffn": (84, 12)}]
    assert cluster.times(20) == pytest.approx([1.6e-3, 1.6e-3])


def test_semi_without_a_re_planner_picks_in_layer(monkeypatch):
    """pp > 1 (the actuator has no planner): the 4x straggler that a cheap re-plan moves at
    step 8 above gets SEMI's in-layer pick there instead, and every semi record says why."""
    cluster = _Cluster()
    controller = _controller(cluster, "semi", monkeypatch)
    controller.actuator = replace(controller.actuator, plan=None)
    _drive(controller, cluster, 15)
    assert cluster.moves == [] and cluster.ops.applied
    assert [step for step, _ in _in_layer(controller)][0] == 8
    semi = [r for r in controller.log.records if "semi" in r["decision"]]
    assert semi and all(r["decision"]["replan"] == "replan unavailable: pp > 1" for r in semi)
    assert all(r["decision"]["semi"]["action"] != "replan" for r in semi)
    assert all(r["decision"]["executed"] != "replan" for r in semi)


def test_semi_without_a_re_planner_takes_no_fallback_re_plan(monkeypatch):
    """As ``test_semi_re_plans_when_its_in_layer_pick_would_not_run`` (no op gains anything
    net), but with no planner (pp > 1): nothing runs, neither ops nor a move."""
    import math

    from colossal_hetero.balance import semi as semi_module

    monkeypatch.setattr(semi_module, "comm_time", lambda *args: math.inf)
    cluster = _Cluster()
    controller = _controller(cluster, "semi", monkeypatch)
    controller.actuator = replace(controller.actuator, plan=None)
    controller.settings = replace(controller.settings, accuracy_weight=1.0)
    _drive(controller, cluster, 15)
    assert cluster.ops.applied == [] and cluster.moves == []
    flagged = [r for r in controller.log.records if r["inputs"]["stragglers"] == [1]]
    assert flagged and all(r["decision"]["executed"] in ("none", "keep") for r in flagged)
