"""Ada-Grouper's decision: the kFkB group size ``k`` for the next steps. Pure.

The runtime half (not here) all-gathers one :class:`LocalMeasurement` row per pipeline rank, so
every rank holds the same matrix; :func:`agree_profile` reduces it to one
:class:`PipelineProfile` and :func:`choose_k` turns that into ``k``. Both are deterministic
functions of the gathered matrix alone, so every rank reaches the same ``k`` without a broadcast.

The choice: simulate one step (:func:`~colossal_hetero.pipeline.simulator.simulate`) for every
candidate ``k`` whose peak activation memory fits every stage's budget, and keep the fastest;
within ``rel_tol`` of the fastest, the smaller ``k`` wins (it holds less memory).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields, replace

from colossal_hetero.pipeline.order import check_pipeline_args, expected_peak_in_flight
from colossal_hetero.pipeline.simulator import SimResult, Trace, simulate


@dataclass(frozen=True, slots=True)
class PipelineProfile:
    """Agreed per-stage inputs of the decision (seconds per micro-batch, bytes)."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    transfer_s: tuple[float, ...]
    """Seconds one micro-batch's activation (or gradient) takes over boundary ``b``; ``p - 1``."""
    activation_bytes: tuple[float, ...]
    """Bytes one in-flight micro-batch keeps alive on each stage."""
    memory_budget_bytes: tuple[float, ...]
    """Bytes each stage may spend on in-flight activations."""
    latency_s: tuple[float, ...] = ()
    """Seconds each boundary adds after a transfer leaves its link (overlaps the next transfer);
    empty means 0 on every boundary."""
    transfer_up_s: tuple[float, ...] = ()
    """Seconds one gradient takes over boundary ``b`` (stage ``b + 1`` to ``b``), when it differs
    from ``transfer_s`` (then that is the activations'); empty: both directions alike."""
    shared_ports: bool = False
    """Whether a stage's sends to both neighbours share one upload, and its receives one
    download (a rank with one network interface; see the simulator)."""
    first_transfer_s: tuple[float, ...] = ()
    """Seconds of each boundary's first activation of a step, from when it is both sent and
    asked for (its metadata exchange included); empty: no such first message."""
    first_transfer_up_s: tuple[float, ...] = ()
    """The same for gradients (empty: as ``first_transfer_s``)."""
    latency_up_s: tuple[float, ...] = ()
    """Latency of the gradients on each boundary, when it differs from ``latency_s`` (then that
    is the activations'); empty: both directions alike."""
    burst_s: tuple[float, ...] = ()
    """Seconds of token-bucket credit an activation on each boundary gets after its link (or
    port) idled (see the simulator); empty: none."""
    burst_up_s: tuple[float, ...] = ()
    """The same for gradients (empty: as ``burst_s``)."""
    token_debt: bool = False
    """Whether a message lands as it starts on its link and pays its transfer time after
    (a shaper that lets a packet through on credit, tc htb: see the simulator)."""
    jitter_s: tuple[float, ...] = ()
    """Per stage, seconds of a mean pass that come as descheduling jumps (the simulator's
    ``jitter_s``); empty: none."""
    first_posted_early: bool = False
    """Whether each kind's first message of a step had its receive posted as the step started
    (moves when sent; the simulator's ``first_early``); then ``first_transfer_s`` is empty."""

    @property
    def num_stages(self) -> int:
        return len(self.forward_s)


@dataclass(frozen=True, slots=True)
class KDecision:
    """The chosen ``k``, its predicted step time, and every feasible candidate's prediction."""

    k: int
    predicted_step_s: float
    step_s_by_k: dict[int, float]
    peak_memory_bytes: tuple[float, ...]


def fits_memory(profile: PipelineProfile, num_microbatches: int, k: int) -> bool:
    """Whether ``min(k (p - s), m)`` micro-batches of activations fit every stage's budget."""
    p = profile.num_stages
    return all(
        expected_peak_in_flight(p, s, num_microbatches, k) * profile.activation_bytes[s]
        <= profile.memory_budget_bytes[s]
        for s in range(p)
    )


def _check_profile(profile: PipelineProfile) -> None:
    p = profile.num_stages
    lengths = (len(profile.backward_s), len(profile.activation_bytes))
    if lengths != (p, p) or len(profile.memory_budget_bytes) != p:
        raise ValueError("profile: every per-stage field needs one value per stage")
    if len(profile.transfer_s) != p - 1:
        raise ValueError(f"profile.transfer_s: {p} stages need {p - 1} boundary times")
    per_boundary = ("transfer_up_s", "first_transfer_s", "first_transfer_up_s", "latency_up_s")
    for name in (*per_boundary, "burst_s", "burst_up_s"):
        if getattr(profile, name) and len(getattr(profile, name)) != p - 1:
            raise ValueError(f"profile.{name}: {p} stages need {p - 1} boundary times")
    if profile.latency_s and len(profile.latency_s) != p - 1:
        raise ValueError(f"profile.latency_s: {p} stages need {p - 1} boundary latencies")
    if profile.jitter_s and len(profile.jitter_s) != p:
        raise ValueError(f"profile.jitter_s: {p} stages need {p} values")
    pairs = zip(profile.activation_bytes, profile.memory_budget_bytes, strict=True)
    for s, (a, m) in enumerate(pairs):
        if m < a:
            raise ValueError(
                f"memory_budget_bytes: stage {s} budget {m:.4g} B is below one micro-batch's "
                f"activations ({a:.4g} B)"
            )


def choose_k(
    profile: PipelineProfile,
    num_microbatches: int,
    candidates: Sequence[int] | None = None,
    rel_tol: float = 1e-9,
) -> KDecision:
    """The fastest memory-feasible ``k`` (default candidates ``1..m``), ties to the smaller.

    ``rel_tol`` is the relative step-time difference below which two candidates tie (it absorbs
    float rounding of sums of times; raise it to make switching ``k`` worth a minimum gain).
    Raises ValueError when a budget is below one micro-batch or no candidate fits.
    """
    _check_profile(profile)
    m = num_microbatches
    ks = sorted(set(range(1, m + 1) if candidates is None else candidates))
    for k in ks:
        check_pipeline_args(profile.num_stages, m, k)
    times: dict[int, float] = {}
    for k in ks:
        if fits_memory(profile, m, k):
            times[k] = _step_time(profile, m, k)
    if not times:
        raise ValueError(
            f"memory_budget_bytes: no k in {ks} keeps the in-flight activations of "
            f"{m} micro-batches within the stage budgets"
        )
    best = min(times.values())
    k = min(c for c, t in times.items() if t <= best * (1 + rel_tol))
    p = profile.num_stages
    peaks = tuple(
        expected_peak_in_flight(p, s, m, k) * profile.activation_bytes[s] for s in range(p)
    )
    return KDecision(k, times[k], times, peaks)


@dataclass(frozen=True, slots=True)
class LocalMeasurement:
    """What one rank measured over the last window, as it goes into the all-gather."""

    forward_s: float
    """Mean seconds of this rank's forward pass per micro-batch."""
    backward_s: float
    transfer_s: float
    """Mean seconds one send to the next stage holds the link (0 on the last stage)."""
    activation_bytes: float
    memory_budget_bytes: float
    latency_s: float = 0.0
    """Seconds a send to the next stage takes beyond its link time (0 on the last stage)."""

    def to_row(self) -> list[float]:
        """The row this rank contributes to the all-gathered ``[world, ROW_WIDTH]`` matrix."""
        return [float(v) for v in astuple(self)]


ROW_WIDTH = len(fields(LocalMeasurement))


def stage_of_rank(pp: int, tp: int, dp: int) -> list[int]:
    """Pipeline stage of every global rank in Colossal-AI's dp-outer layout (dp, pp, tp)."""
    return [(r // tp) % pp for r in range(dp * pp * tp)]


def tp_index_of_rank(pp: int, tp: int, dp: int) -> list[int]:
    """Tensor-parallel rank of every global rank in the same layout (``stage_of_rank``)."""
    return [r % tp for r in range(dp * pp * tp)]


def agree_profile(
    rows: Sequence[Sequence[float]], stage_of_rank: Sequence[int], num_stages: int
) -> PipelineProfile:
    """Reduce all-gathered rows (row ``r`` from rank ``r``) to one profile, the same on every rank.

    Ranks of one stage (its tensor- and data-parallel peers) run in lockstep, so the stage takes
    its slowest rank's times and largest activations, and its smallest budget. Only max and min
    are used: exact in floating point and independent of the order of the rows.
    """
    if len(rows) != len(stage_of_rank) or any(len(r) != ROW_WIDTH for r in rows):
        raise ValueError(f"rows: need one row of {ROW_WIDTH} values per rank in stage_of_rank")
    if any(not math.isfinite(v) for r in rows for v in r):
        raise ValueError("rows: measurements must be finite")
    owned = list(zip(stage_of_rank, rows, strict=True))
    members = [[r for s, r in owned if s == st] for st in range(num_stages)]
    if any(not m for m in members):
        raise ValueError(f"stage_of_rank: every stage 0..{num_stages - 1} needs a rank")

    def per_stage(col: int, smallest: bool = False) -> tuple[float, ...]:
        pick = min if smallest else max
        return tuple(pick(row[col] for row in m) for m in members)

    return PipelineProfile(
        forward_s=per_stage(0),
        backward_s=per_stage(1),
        transfer_s=per_stage(2)[:-1],
        activation_bytes=per_stage(3),
        memory_budget_bytes=per_stage(4, smallest=True),
        latency_s=per_stage(5)[:-1],
    )


def choose_k_over_window(
    profiles: Sequence[PipelineProfile],
    num_microbatches: int,
    min_gain: float = 1e-9,
    candidates: Sequence[int] | None = None,
    cache: dict[tuple[PipelineProfile, int], float] | None = None,
    current_k: int | None = None,
) -> KDecision:
    """The ``k`` with the least predicted total time over recent steps' ``profiles``. Pure.

    A shared link changes from step to step (a tenant comes and goes), and a decision lands one
    step after the step it was measured on; the ``k`` that is fastest summed over the last few
    steps stays good through such flips, where the last step's best one lags each of them. Each
    candidate must fit every stage's budget under the largest activations of the window (the
    budget of its last profile). The smallest ``k`` whose summed time is within ``min_gain`` of
    one step (the best sum over the window's length) of the best wins, as in
    :func:`choose_k`. ``step_s_by_k`` in the result holds each
    candidate's summed time over the window; one profile is exactly :func:`choose_k`.

    ``current_k`` (optional) wins the tie instead, while it fits: a ``k`` that hides every
    transfer measures free links (no receive waits), on which every ``k`` ties; falling back to
    the smallest would expose the link again, and the next step would raise ``k`` again.

    ``cache`` (the caller's, optional) keeps each ``(profile, k)``'s simulated step time, so a
    retuning step simulates only its new profile: a window's older steps were simulated before.
    """
    if not profiles:
        raise ValueError("profiles: need at least one step's profile")
    last = profiles[-1]
    largest = tuple(max(p.activation_bytes[s] for p in profiles) for s in range(last.num_stages))
    budget = last.memory_budget_bytes
    # One memory profile for every step: each step has the same feasible candidates.
    memory = replace(last, activation_bytes=largest, memory_budget_bytes=budget)
    _check_profile(memory)
    m = num_microbatches
    ks = sorted(set(range(1, m + 1) if candidates is None else candidates))
    for k in ks:
        check_pipeline_args(last.num_stages, m, k)
    fitting = [k for k in ks if fits_memory(memory, m, k)]
    if not fitting:
        choose_k(memory, m, ks)  # raises the budget's ValueError
    cache = {} if cache is None else cache
    total = dict.fromkeys(fitting, 0.0)
    for profile in profiles:
        for k in fitting:
            if (profile, k) not in cache:
                cache[(profile, k)] = _step_time(profile, m, k)
            total[k] += cache[(profile, k)]
    best = min(total.values())
    # A saving over the window ties when below min_gain of one step (the window's mean best):
    # of the whole sum, the first preempted step after free ones could not move k.
    tied = [c for c, t in total.items() if t <= best * (1 + min_gain / len(profiles))]
    k = current_k if current_k in tied else min(tied)
    p = last.num_stages
    peaks = tuple(expected_peak_in_flight(p, s, num_microbatches, k) * largest[s] for s in range(p))
    return KDecision(k, total[k], total, peaks)


def _step_time(profile: PipelineProfile, num_microbatches: int, k: int) -> float:
    """The simulated step time of ``profile`` under ``k`` (memory not checked)."""
    return simulate_profile(profile, num_microbatches, k, keep_events=False).step_time


def simulate_profile(
    profile: PipelineProfile, num_microbatches: int, k: int, keep_events: bool = True
) -> SimResult:
    """One simulated step of ``profile`` under ``k``: constant link times, latencies and
    token-bucket credits, each direction's own when ``transfer_up_s`` / ``latency_up_s`` /
    ``burst_up_s`` is given, shared stage ports when ``shared_ports``, messages charged after
    they land when ``token_debt``, descheduling jumps ``jitter_s`` (``keep_events``: see
    :func:`~colossal_hetero.pipeline.simulator.simulate`)."""
    up = profile.transfer_up_s or profile.transfer_s
    return simulate(
        profile.forward_s,
        profile.backward_s,
        [Trace.constant(c) for c in profile.transfer_s],
        num_microbatches,
        k,
        activation_bytes=profile.activation_bytes,
        latency_s=profile.latency_s or None,
        up_latency_s=profile.latency_up_s or None,
        up_transfers=[Trace.constant(c) for c in up],
        shared_ports=profile.shared_ports,
        first_s=profile.first_transfer_s or None,
        first_up_s=profile.first_transfer_up_s or None,
        burst_s=profile.burst_s or None,
        up_burst_s=profile.burst_up_s or None,
        keep_events=keep_events,
        token_debt=profile.token_debt,
        jitter_s=profile.jitter_s or None,
        first_early=profile.first_posted_early,
    )
