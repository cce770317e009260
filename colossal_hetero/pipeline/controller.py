"""Runtime half of the Ada tuner: every ``period`` steps, agree on measurements and retune ``k``.

Decide purely, agree once, act everywhere: at a retuning step every rank contributes one
:class:`~colossal_hetero.pipeline.tuner.LocalMeasurement` row to **one** ``all_gather`` over
``group`` (the world by default), then runs the pure :func:`agree_profile` and
:func:`choose_k` on the identical matrix, so every rank sets the same ``k`` without a broadcast.
Whether a step retunes depends on the step number alone, so the collective sequence is the same
on every rank. Call :meth:`AdaKController.after_step` on every rank after each training step
(a step boundary: the schedule is idle).

Link time is measured: each rank's row is its :class:`~colossal_hetero.pipeline.profile.RankRecord`
of the last step (compute seconds, activation bytes and a clock time per message sent or
received), so :func:`~colossal_hetero.pipeline.profile.profile_from_records` derives every
boundary's link seconds from both ends' timestamps, the same on every rank. Under the emulation's
model mode those are the modelled transfers (the interceptor books the schedule's
``isend``/``irecv`` on the link timeline), on shaped links the real ones. ``latency_s`` adds a
configured per-message latency on top (0 in the plugin: the measurement includes it).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from colossal_hetero.pipeline.link_shares import Direction, LinkShareTuner, scaled_profile
from colossal_hetero.pipeline.measured import MeasuredGuard
from colossal_hetero.pipeline.profile import (
    RankRecord,
    profile_from_records,
    record_from_vector,
    vector_width,
)
from colossal_hetero.pipeline.schedule import KFKBSchedule
from colossal_hetero.pipeline.tuner import (
    PipelineProfile,
    choose_k_over_window,
    simulate_profile,
)
from colossal_hetero.utils.device import collective_device

_Units = dict[Direction, tuple[int, ...]]


class AdaKController:
    """Retunes ``schedule.k`` every ``period`` steps under each stage's activation budget.

    Args:
        schedule: this rank's :class:`KFKBSchedule` (its ``last_record`` is the measurement).
        stage_of_rank: pipeline stage of every rank of ``group``, in group-rank order.
        memory_budget_bytes: bytes this rank may spend on in-flight activations.
        latency_s: seconds added per message on this rank's outgoing link, beyond the measured
            link time.
        period: retune after steps ``period - 1, 2 * period - 1, ...`` (0-based step numbers).
        min_gain: candidates predicted within this fraction of one step of the fastest tie, and
            the smallest of them wins: measured compute jitters, and a k chosen on noise would
            flap.
        window: how many retuning steps' profiles the choice sums over
            (:func:`~colossal_hetero.pipeline.tuner.choose_k_over_window`): a k good over the
            last few steps rides out a link that flips between steps; 1 uses the last step.
        sticky: on a tie keep the running ``k`` rather than the smallest (``current_k`` of
            ``choose_k_over_window``): transfers a grouped ``k`` hides measure as free.
        overlap: run a retuning step's gather in the background and decide it after the next
            step (see :meth:`after_step`); ``group`` should then be one the steps do not use, or
            the gather waits for their collectives on it.
        early: with ``overlap``, decide in the next step, before its first pass that depends
            on ``k`` (:meth:`before_step`, installed as ``schedule.before_step``): ``k`` changes
            one step earlier, and that step waits for whatever of the gather is still in flight.
        guard: checks the simulator's choice against the step times measured at each ``k``
            (:class:`~colossal_hetero.pipeline.measured.MeasuredGuard`: refuted switches,
            exploration of neighbours); None follows the simulator alone.
        link_shares: also place each boundary's message pieces over its TP links by their
            measured speeds (:class:`~colossal_hetero.pipeline.link_shares.LinkShareTuner`,
            ``KFKBSchedule.set_link_units``): decided with ``k`` from the same gathered records,
            applied at the next step boundary (the receives of a step are posted as it starts,
            so units decided inside a step wait for its end). None: equal pieces.
        start_free: the first retuning takes the fastest predicted ``k`` (ties within float
            rounding to the smaller), without ``min_gain`` or ``sticky``: both are hysteresis
            against flapping between the tuner's own choices, and the ``k`` the first measured
            step ran is the configured start (``parallel.pp_k``), not one. With them, the bench's
            idle PP=2 x TP=2 (a) kept its start ``k = 1`` where the simulator put ``k = 2``
            0.2-1.6% ahead (sessions 11-12); static ``k = 2`` ran faster than ``k = 1`` in 4
            of 6 such runs (sessions 9-12, median of the runs' medians 1.04x).
    """

    def __init__(
        self,
        schedule: KFKBSchedule,
        stage_of_rank: list[int],
        memory_budget_bytes: float,
        latency_s: float = 0.0,
        period: int = 10,
        group: dist.ProcessGroup | None = None,
        min_gain: float = 0.01,
        window: int = 1,
        sticky: bool = False,
        overlap: bool = False,
        early: bool = False,
        guard: MeasuredGuard | None = None,
        start_free: bool = False,
        link_shares: LinkShareTuner | None = None,
    ) -> None:
        if period < 1:
            raise ValueError(f"period: retune every >= 1 steps, got {period}")
        if window < 1:
            raise ValueError(f"window: retune over >= 1 steps, got {window}")
        if early and not overlap:
            raise ValueError("early: deciding before the next step needs overlap=True")
        self._profiles: deque[PipelineProfile] = deque(maxlen=window)
        self._cache: dict[tuple[PipelineProfile, int], float] = {}
        """Simulated step time per (window profile, k): each profile is simulated once."""
        self.schedule, self.stage_of_rank, self.period = schedule, stage_of_rank, period
        self.memory_budget_bytes = memory_budget_bytes
        self.latency_s, self.group, self.min_gain = latency_s, group, min_gain
        self.sticky, self.overlap, self.guard = sticky, overlap, guard
        self.start_free, self.link_shares = start_free, link_shares
        self._retunings = 0
        self._pending: tuple[dist.Work, list[torch.Tensor], torch.Tensor, int, int, _Units] | None
        self._pending = None
        """With ``overlap``: the gather in flight, its rows, its row (kept alive until the
        gather is done), the step it measured, the ``k`` and the link units that step ran."""
        self._units: _Units = {} if link_shares is None else dict(link_shares.units)
        """The link units the schedule runs with now."""
        self._units_due: _Units | None = None
        """Units decided but not yet applied (at the next step boundary)."""
        self._decided: dict[str, Any] | None = None
        """With ``early``: the record decided by :meth:`before_step`, until ``after_step``."""
        if early:
            schedule.before_step = self.before_step

    def local_row(self, num_microbatches: int) -> list[float]:
        """This rank's row: its last step's record, then its budget and outgoing latency."""
        record = self.schedule.last_record
        assert record is not None, "after_step before any training step"
        latency = 0.0 if record.next_rank is None else self.latency_s
        return [*record.to_vector(num_microbatches), self.memory_budget_bytes, latency]

    def after_step(self, step: int) -> dict[str, Any] | None:
        """At retuning steps: gather, decide, ``set_k``; returns the decision record, else None.

        Collective: one ``all_gather`` of a float64 row per rank over ``group`` (the record's
        ``8 m + 10`` values, budget, latency). With ``overlap`` the gather runs in the
        background through the next step and is decided after it (``k`` changes one step
        later; the record names the step measured): on a preempted link the gather costs as
        much as a transfer, which a blocking one adds to every retuning step. With ``early``
        :meth:`before_step` decided it already; the record is returned here. A decided record
        carries ``gather_wait_s``: how long this rank waited for the gather.
        """
        ran = self.schedule.k  # what this step ran: a pending decision applies to the next
        ran_units = self._units
        record, self._decided = self._decided, None
        if record is None:
            record = self._settle()
        self._apply_units()  # a step boundary: no receive of the next step is posted yet
        if (step + 1) % self.period:
            return record
        m = self.schedule.num_microbatches
        assert m is not None
        wire = collective_device(self.group)
        mine = torch.tensor(self.local_row(m), dtype=torch.float64, device=wire)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        work = dist.all_gather(rows, mine, group=self.group, async_op=True)
        assert work is not None
        if self.overlap:
            self._pending = (work, rows, mine, step, ran, ran_units)
            return record
        work.wait()
        decided = self._decide(rows, step, ran, ran_units)
        self._apply_units()
        return decided

    def _apply_units(self) -> None:
        """Hand decided link units to the schedule (call at a step boundary only)."""
        if self._units_due is None or self.link_shares is None:
            return
        self._units, self._units_due = self._units_due, None
        self.schedule.set_link_units(*self.link_shares.per_boundary())

    def before_step(self) -> None:
        """``early``: decide the gather in flight before a step's first ``k``-dependent pass
        (``set_k``; ``KFKBSchedule.before_step`` says where), so the step runs the ``k``
        decided from the one before it. Every rank waits for the same gather and decides on
        the same rows: the same ``k`` everywhere, before any pass that depends on it."""
        if self._pending is not None:
            self._decided = self._settle()

    def _settle(self) -> dict[str, Any] | None:
        """Wait for the gather in flight (if any) and decide it; the record notes the wait."""
        if self._pending is None:
            return None
        work, rows, _, measured, ran, ran_units = self._pending
        self._pending = None
        began = time.perf_counter()
        work.wait()
        waited = time.perf_counter() - began
        return {**self._decide(rows, measured, ran, ran_units), "gather_wait_s": waited}

    def _decide(
        self, rows: list[torch.Tensor], step: int, ran: int, ran_units: _Units | None = None
    ) -> dict[str, Any]:
        """Agree on the profile from the gathered rows, choose and set ``k``; the record.
        ``ran``: the ``k`` of the step measured, ``ran_units`` its link units (None: the
        running ones). The record's ``decide_s``: this rank's seconds
        in here (profile, simulations, guard), the tuner's own cost of the retuning."""
        began = time.perf_counter()
        m = self.schedule.num_microbatches
        assert m is not None
        num_stages = self.schedule.stage_manager.num_stages
        gathered = [r.tolist() for r in rows]
        width = vector_width(m)
        records = [record_from_vector(r[:width], m) for r in gathered]
        profile = agreed_profile(gathered, self.stage_of_rank, num_stages, m, records)
        self._profiles.append(profile)  # identical on every rank: so is the window
        window = list(self._profiles)
        free = self.start_free and self._retunings == 0  # the running k is the start k
        current = self.schedule.k if self.sticky and not free else None
        min_gain = 1e-9 if free else self.min_gain
        decision = choose_k_over_window(
            window, m, min_gain=min_gain, cache=self._cache, current_k=current
        )
        self._cache = {key: t for key, t in self._cache.items() if key[0] in window}
        previous = self.schedule.k
        measured_s = max(r.step_s for r in records)  # as measured_step_s
        chosen, reason = decision.k, "model" if decision.k != ran else "kept"
        if self.guard is not None:
            times = decision.step_s_by_k
            latest = {k: self._cache[(profile, k)] for k in times}  # this step's profile alone
            chosen, reason = self.guard.choose(
                self._retunings, ran, measured_s, decision.k, times, latest
            )
        self._retunings += 1
        self.schedule.set_k(chosen)
        judge = partial(_step_gain, profile, m, chosen)
        links = self._decide_units(records, self._units if ran_units is None else ran_units, judge)
        before = decision.step_s_by_k.get(previous)  # None: the old k no longer fits memory
        gain = None if before is None else before / decision.step_s_by_k[chosen] - 1
        return {
            "step": step,
            "controller": "ada_kfkb",
            "inputs": {
                "forward_s": profile.forward_s,
                "backward_s": profile.backward_s,
                "transfer_s": profile.transfer_s,
                "latency_s": profile.latency_s,
                "transfer_up_s": profile.transfer_up_s,
                "latency_up_s": profile.latency_up_s,
                "activation_bytes": profile.activation_bytes,
                "memory_budget_bytes": profile.memory_budget_bytes,
            },
            "decision": {"k": chosen, "previous_k": previous},
            "model_k": decision.k,
            "reason": reason,
            "measured_s": measured_s,
            "ran_k": ran,
            "window": len(self._profiles),
            # Each fitting k's predicted seconds summed over the window: what the choice (and
            # the guard) compared, for checking it against the step times measured per k.
            "predicted_s_by_k": {int(c): t for c, t in decision.step_s_by_k.items()},
            "predicted_gain": gain,
            **links,
            "decide_s": time.perf_counter() - began,
        }

    def _decide_units(
        self,
        records: list[RankRecord],
        ran_units: _Units,
        step_gain: Callable[[Direction, float], float],
    ) -> dict[str, Any]:
        """Link units from the gathered records (due at the next step boundary); the record's
        ``link_units`` (per direction, ``"F0"`` for activations over boundary 0, ...), or {}."""
        if self.link_shares is None:
            return {}
        units = self.link_shares.decide(records, ran_units, step_gain)
        self._units_due = units if units != self._units else None
        return {"link_units": {f"{op}{b}": list(u) for (op, b), u in sorted(units.items())}}


def _step_gain(
    profile: PipelineProfile, num_microbatches: int, k: int, direction: Direction, factor: float
) -> float:
    """The simulated step's relative gain at ``k`` when ``direction``'s message times on its
    boundary are scaled by ``factor`` (new link units; ``link_shares.scaled_profile``)."""
    now = simulate_profile(profile, num_microbatches, k, keep_events=False).step_time
    scaled = scaled_profile(profile, direction, factor)
    then = simulate_profile(scaled, num_microbatches, k, keep_events=False).step_time
    return 1.0 - then / now if now > 0 else 0.0


def measured_step_s(rows: list[list[float]], num_microbatches: int) -> float:
    """The measured step: the slowest rank's schedule seconds in the gathered rows."""
    width = vector_width(num_microbatches)
    return max(record_from_vector(r[:width], num_microbatches).step_s for r in rows)


def agreed_profile(
    rows: list[list[float]],
    stage_of_rank: list[int],
    num_stages: int,
    num_microbatches: int,
    records: list[RankRecord] | None = None,
) -> PipelineProfile:
    """The profile every rank derives from the gathered rows (pure; order of rows irrelevant):
    measured compute, activations, link times and latencies, each stage's smallest budget,
    each boundary's largest configured latency added to its measured ones. ``records``: the
    rows' records when the caller parsed them already."""
    width = vector_width(num_microbatches)
    if records is None:
        records = [record_from_vector(r[:width], num_microbatches) for r in rows]
    budgets = [
        min(r[width] for r, s in zip(rows, stage_of_rank, strict=True) if s == st)
        for st in range(num_stages)
    ]
    latency = [
        max(r[width + 1] for r, s in zip(rows, stage_of_rank, strict=True) if s == b)
        for b in range(num_stages - 1)
    ]
    profile = profile_from_records(records, num_stages, budgets)
    measured = (profile.latency_s, profile.latency_up_s)
    down, up = (tuple(a + b for a, b in zip(m, latency, strict=True)) for m in measured)
    return replace(profile, latency_s=down, latency_up_s=up)
