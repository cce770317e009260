"""The runtime controller without processes: the gather is replaced by synthetic rows of two
ranks whose compute follows the model the controller assumes (phi + (1 - phi) * n * share
units of work at the device's speed), so every decision is determined by hand.

Rank 1 is 4x slow for steps 6..29: the detector flags it, replan moves rank 0 to more work,
and after recovery the controller moves back to the even widths; each move is followed by a
measured-gain record; SEMI logs an in-layer pick as not executable and runs the fallback."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from colossal_hetero.balance import controller as module
from colossal_hetero.balance.controller import Actuator, BalanceController
from colossal_hetero.balance.detector import shares_of, work_units
from colossal_hetero.balance.window import Report, pack
from colossal_hetero.config.schema import BalancerConfig
from colossal_hetero.emulation import StepTiming
from colossal_hetero.metrics.decisions import DecisionWriter

EVEN = {"ffn": (48, 48)}
SKEW = {"ffn": (76, 20)}
PHI = 0.2


def _timing(step: int, compute: float) -> StepTiming:
    return StepTiming(step, 2 * compute, compute, compute, 0.0, 0.0)


class _Cluster:
    """Two ranks' synthetic compute: ``1 ms * work units * slowdown``."""

    def __init__(self) -> None:
        self.widths: dict[str, tuple[int, ...]] = dict(EVEN)
        self.moves: list[dict] = []

    def slow(self, step: int) -> float:
        return 4.0 if 6 <= step < 30 else 1.0

    def times(self, step: int) -> list[float]:
        units = work_units(shares_of(self.widths, 2), PHI)
        return [1e-3 * units[0], 1e-3 * units[1] * self.slow(step)]

    def plan(self, speeds: tuple[float, ...]) -> dict[str, tuple[int, ...]]:
        return dict(SKEW) if speeds[1] < 0.5 else dict(EVEN)  # the planner's stand-in

    def resize(self, widths: dict) -> None:
        self.moves.append(dict(widths))
        self.widths = dict(widths)


def _controller(cluster: _Cluster, mode: str, monkeypatch: Any) -> BalanceController:
    settings = BalancerConfig(
        mode=mode,  # type: ignore[arg-type]
        every=3,
        window=3,
        smoothing=1.0,  # no memory: the vector follows each window, so steps are by hand
        stable_steps=3,
        horizon_steps=1000,
        move_cost_s=0.01,
        fixed_fraction=PHI,
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
        actuator=Actuator(lambda: dict(cluster.widths), cluster.plan, cluster.resize),
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
    # Flagged at 8 (stability restarts), stable at 11 -> move; recovered at 30: the window
    # 30..32 at 32, stable at 35 -> back.
    assert moves == [(11, {"ffn": [76, 20]}), (35, {"ffn": [48, 48]})]
    assert cluster.moves == [SKEW, EVEN]
    measured = [r for r in records if r["decision"]["action"] == "measured"]
    assert [r["inputs"]["decision_step"] for r in measured] == [11, 35]
    # Every later window at the skewed widths reads the same speeds: no further move.
    assert all(r["predicted_gain"] > 0 for r in records if r["decision"]["action"] == "resize")
    slow_at_skew = [d for d in controller.detections if 14 <= d.step < 30]
    assert all(d.slowdown == pytest.approx((1.0, 4.0)) for d in slow_at_skew)


def test_semi_logs_in_layer_picks_as_not_executable(monkeypatch):
    cluster = _Cluster()
    controller = _controller(cluster, "semi", monkeypatch)
    _drive(controller, cluster, 15)
    semi = [r["decision"] for r in controller.log.records if "semi" in r["decision"]]
    picked = [d for d in semi if d["semi"]["action"] == "in_layer"]
    assert all("not executable: layer ops not built" in d["semi_reason"] for d in picked)
    assert all(d["executed"] in ("none", "replan") for d in semi)
    assert cluster.moves == [SKEW]  # the re-plan ran as the executable fallback
