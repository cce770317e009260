"""Runtime half of the Ada tuner: every ``period`` steps, agree on measurements and retune ``k``.

Decide purely, agree once, act everywhere: at a retuning step every rank contributes one
:class:`~colossal_hetero.pipeline.tuner.LocalMeasurement` row to **one** ``all_gather`` over
``group`` (the world by default), then runs the pure :func:`agree_profile` and
:func:`choose_k` on the identical matrix, so every rank sets the same ``k`` without a broadcast.
Whether a step retunes depends on the step number alone, so the collective sequence is the same
on every rank. Call :meth:`AdaKController.after_step` on every rank after each training step
(a step boundary: the schedule is idle).

Link time is not measured here: ``link_seconds(message_bytes)`` converts this rank's message size
into seconds on its outgoing link (from the network metrics or the configured bandwidth), and
``latency_s`` adds the per-message latency.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from colossal_hetero.pipeline.schedule import KFKBSchedule
from colossal_hetero.pipeline.tuner import (
    ROW_WIDTH,
    LocalMeasurement,
    agree_profile,
    choose_k,
)


class AdaKController:
    """Retunes ``schedule.k`` every ``period`` steps under each stage's activation budget.

    Args:
        schedule: this rank's :class:`KFKBSchedule` (its ``last_stats`` are the measurements).
        stage_of_rank: pipeline stage of every rank of ``group``, in group-rank order.
        memory_budget_bytes: bytes this rank may spend on in-flight activations.
        link_seconds: seconds one message of the given bytes holds this rank's outgoing link.
        latency_s: seconds added per message on this rank's outgoing link.
        period: retune after steps ``period - 1, 2 * period - 1, ...`` (0-based step numbers).
        min_gain: candidates predicted within this fraction of the fastest tie, and the smallest
            of them wins: measured compute jitters, and a k chosen on noise would flap.
    """

    def __init__(
        self,
        schedule: KFKBSchedule,
        stage_of_rank: list[int],
        memory_budget_bytes: float,
        link_seconds: Callable[[int], float],
        latency_s: float = 0.0,
        period: int = 10,
        group: dist.ProcessGroup | None = None,
        min_gain: float = 0.01,
    ) -> None:
        if period < 1:
            raise ValueError(f"period: retune every >= 1 steps, got {period}")
        self.schedule, self.stage_of_rank, self.period = schedule, stage_of_rank, period
        self.memory_budget_bytes, self.link_seconds = memory_budget_bytes, link_seconds
        self.latency_s, self.group, self.min_gain = latency_s, group, min_gain

    def local_row(self) -> list[float]:
        """This rank's measurement row from the last step (the last stage sends nothing)."""
        stats = self.schedule.last_stats
        assert stats is not None, "after_step before any training step"
        last = self.schedule.stage_manager.is_last_stage()
        return LocalMeasurement(
            forward_s=stats.forward_s,
            backward_s=stats.backward_s,
            transfer_s=0.0 if last else self.link_seconds(stats.message_bytes),
            activation_bytes=float(stats.activation_bytes),
            memory_budget_bytes=self.memory_budget_bytes,
            latency_s=0.0 if last else self.latency_s,
        ).to_row()

    def after_step(self, step: int) -> dict[str, Any] | None:
        """At retuning steps: gather, decide, ``set_k``; returns the decision record, else None.

        Collective: one ``all_gather`` of a float64 ``[ROW_WIDTH]`` tensor over ``group``.
        """
        if (step + 1) % self.period:
            return None
        mine = torch.tensor(self.local_row(), dtype=torch.float64)
        size = dist.get_world_size(self.group)
        rows = [torch.empty(ROW_WIDTH, dtype=torch.float64) for _ in range(size)]
        dist.all_gather(rows, mine, group=self.group)
        matrix = [r.tolist() for r in rows]
        num_stages = self.schedule.stage_manager.num_stages
        profile = agree_profile(matrix, self.stage_of_rank, num_stages)
        m = self.schedule.num_microbatches
        assert m is not None
        decision = choose_k(profile, m, rel_tol=self.min_gain)
        previous = self.schedule.k
        self.schedule.set_k(decision.k)
        before = decision.step_s_by_k.get(previous)  # None: the old k no longer fits memory
        return {
            "step": step,
            "controller": "ada_kfkb",
            "inputs": {"rows": matrix},
            "decision": {"k": decision.k, "previous_k": previous},
            "predicted_gain": None if before is None else before / decision.predicted_step_s - 1,
        }
