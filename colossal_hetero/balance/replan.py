"""Online re-planning, pure: measured speeds in, new widths and whether the move pays out.

No torch.distributed. The planner is the one the plugin plans with at ``configure``
(``planner.resolve.plan_for_model``); only the devices' speeds change, to the measured ones.
Every rank calls it with the same agreed speeds and gets the same widths (the planner is
deterministic; ``plugin.resize`` checks the widths agree before it moves anything).

Gain model: a rank's compute is taken as ``phi + (1 - phi) * n * share`` units of work
(``detector.work_units``; ``phi = balancer.fixed_fraction``, the part that does not scale with
the widths), so under new shares its per-step compute becomes ``t_i * new_i / old_i`` in those
units and the group's step (bulk synchronous: the slowest rank) saves
``max_i t_i - max_i t_i * new_i / old_i``. The controller logs the measured gain of the next
window beside each move so that the model can be checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from colossal_hetero.balance.detector import MIN_SHARE, shares_of, work_units
from colossal_hetero.config.schema import DeviceSpec, HeteroConfig


@dataclass(frozen=True, slots=True)
class ReplanDecision:
    """What the re-planner decided at one agreement."""

    action: str
    """none or resize."""
    widths: dict[str, tuple[int, ...]]
    """The widths to run (the current ones when ``action`` is none)."""
    predicted_gain: float
    """Predicted seconds saved per step by the move (0 when none is planned)."""
    reason: str


def measured_config(config: HeteroConfig, speeds: Sequence[float], world_size: int) -> HeteroConfig:
    """``config`` with each device's speed replaced by its tensor-parallel position's measured
    relative ``speeds`` (device ``d`` sits at position ``d % tp``); memory and bandwidth stay
    as declared, and ``plan.mode`` becomes auto (a plan file is not re-planned)."""
    tp = config.parallel.tp
    assert len(speeds) == tp
    declared = list(config.cluster.devices) or [DeviceSpec()] * world_size
    devices = [replace(d, speed=float(speeds[i % tp])) for i, d in enumerate(declared)]
    return replace(
        config,
        cluster=replace(config.cluster, devices=devices),
        plan=replace(config.plan, mode="auto", path=None),
    )


def plan_widths(
    config: HeteroConfig,
    model: Any,
    world_size: int,
    workload: tuple[int, int] | None,
    speeds: Sequence[float],
) -> dict[str, tuple[int, ...]]:
    """The planner's widths for ``model`` on devices at the measured ``speeds``.

    Raises:
        ConfigError: the planner finds the layout infeasible at these speeds.
    """
    from colossal_hetero.planner.resolve import plan_for_model

    plan = plan_for_model(measured_config(config, speeds, world_size), model, world_size, workload)
    return {key: tuple(counts) for key, counts in plan.widths.items()}


MIN_PLANNING_SPEED = 1e-3
"""The smallest relative speed handed to the planner (a rank that should get no width)."""


def planning_speeds(speeds: Sequence[float], fixed_fraction: float) -> tuple[float, ...]:
    """The relative speeds to plan widths with so that the work model's times balance.

    The planner splits the widths about in proportion to the speeds it is given, as if all of
    a rank's work scaled with them. Under the work model a rank's time is
    ``(phi + (1 - phi) * n * x_i) / v_i`` (``x_i`` its share): its fixed part runs at its own
    speed too, so a slow rank must take less than its speed's share. Equal times ``T`` over
    the ranks given work (``A``) mean ``x_i = (T v_i - phi) / (n (1 - phi))`` with
    ``T = (n (1 - phi) + phi |A|) / sum_A v``; a rank whose ``x_i`` would not be positive
    gets none and ``T`` is solved again without it. Returns the shares over the largest
    (``MIN_PLANNING_SPEED`` at least): ``speeds`` themselves when ``phi`` is 0.
    """
    n = len(speeds)
    phi = min(max(fixed_fraction, 0.0), 0.9)
    active = [i for i in range(n) if speeds[i] > 0]
    shares = [0.0] * n
    while active:
        t = (n * (1 - phi) + phi * len(active)) / sum(speeds[i] for i in active)
        shares = [0.0] * n
        for i in active:
            shares[i] = (t * speeds[i] - phi) / (n * (1 - phi))
        dropped = [i for i in active if shares[i] <= 0]
        if not dropped:
            break
        active = [i for i in active if shares[i] > 0]
    top = max(shares)
    if top <= 0:
        return tuple(speeds)
    return tuple(max(x / top, MIN_PLANNING_SPEED) for x in shares)


def flagged_speeds(slowdown: Sequence[float], stragglers: Sequence[int]) -> tuple[float, ...]:
    """The relative speeds to re-plan with: 1 for every unflagged rank, and a flagged rank's
    slowdown taken over the unflagged ranks' mean (1 when every rank is flagged).

    The detector flags a rank only above ``1 + threshold``: below it, differences are timing
    noise, and planning with them gave equal devices unequal widths. In a quiet session-8
    run GPT-2's first re-plan read equal devices at 1.08, 1.0 and 1.07 and gave the one at
    1.0 three heads of eight and 495 ffn columns against 441 and 448 (the oracle: 442 each);
    that rank then computed the most. Equal speeds also keep such noise from moving the
    planning speeds away from those the widths were planned with (``off_plan``).
    """
    flagged = set(stragglers)
    calm = [s for i, s in enumerate(slowdown) if i not in flagged]
    base = sum(calm) / len(calm) if calm else 1.0
    return tuple(min(base / s, 1.0) if i in flagged else 1.0 for i, s in enumerate(slowdown))


NEAR_EMPTY = 0.25
"""A flagged rank whose ``n * share`` of the scaling work is under this runs mostly its fixed
part: its per-unit reading then follows the fitted fixed fraction more than its speed."""


def measurable_slowdown(slowdown: Sequence[float], shares: Sequence[float]) -> tuple[float, ...]:
    """``slowdown`` taken over the least reading of the ranks that hold scaling work
    (``n * share >= NEAR_EMPTY``); a rank near no work reads at least that (1).

    The detector reads slowdowns against the fastest rank, and a rank near no work is read
    on its fixed part alone: once it recovers it may read fastest of all, and every loaded
    rank then reads slow against it. In a quiet session-9 run GPT-2's 4x rank, left with no
    heads, recovered and read [1.82, 1.0, 1.80, 2.95] (true [1, 1, 1, 2]); the re-plan gave
    it 5 of 8 heads and 928 ffn columns, and the step ran 0.17 s against 0.13 s before.
    """
    n = len(slowdown)
    loaded = [s for s, x in zip(slowdown, shares, strict=True) if n * x >= NEAR_EMPTY]
    if not loaded:
        return tuple(slowdown)
    least = min(loaded)
    return tuple(max(s / least, 1.0) for s in slowdown)


def reading_drops(
    slowest: dict[int, float] | None, readings: Sequence[float]
) -> tuple[dict[int, float], tuple[float, ...]]:
    """Per rank, the slowest of its readings at the present widths (``slowest``, updated with
    ``readings``) over its present one, and the updated record. ``slowest`` None marks the
    first agreement after a move, whose window may hold steps at the old widths: it is not
    recorded (drops 1), and the record starts at the next."""
    if slowest is None:
        return {}, (1.0,) * len(readings)
    kept = {i: max(slowest.get(i, r), r) for i, r in enumerate(readings)}
    return kept, tuple(kept[i] / r for i, r in enumerate(readings))


RECOVERY_DROP = 1.5
"""A near-empty flagged rank whose reading fell to under 1 / this of the slowest it read at
its present widths has sped up (``balance.recovery``: the controller releases it)."""


def held_speeds(
    speeds: Sequence[float],
    held: Sequence[float] | None,
    shares: Sequence[float],
    stragglers: Sequence[int],
) -> tuple[float, ...]:
    """``speeds`` (``flagged_speeds``) with every flagged rank left near no scaling work
    (``n * share < NEAR_EMPTY``) kept at no more than ``held``, the speed its widths were
    planned at: its reading may lower its speed (it holds the step) but not raise it until
    its flag is released (a recovery: it plans at 1 then; ``balance.recovery`` releases a
    near-empty rank whose readings at the same widths fell, since its level alone may never
    fall under the release threshold).

    Such a rank is measured on its fixed part alone, and a fixed fraction fitted 0.1 too
    high reads it faster than it is: in the quiet session-8 run Llama's 2x rank, planned at
    no heads and 11 ffn columns, read 1.14x at the refitted 0.63 and the next re-plan gave it
    2 heads and 204 ffn columns (measured 0.155 s/step lost); the same flapping between its
    empty and oracle-like widths recurred in each 2x phase of a session-9 run.
    """
    n = len(speeds)
    if held is None:
        return tuple(speeds)
    return tuple(
        min(v, held[i]) if i in stragglers and n * shares[i] < NEAR_EMPTY else v
        for i, v in enumerate(speeds)
    )


def off_plan(target: Sequence[float], planned_with: Sequence[float], tolerance: float) -> bool:
    """Whether the speeds to plan with now (``planning_speeds`` of the measured speeds at the
    fitted fixed fraction) moved away from ``planned_with``, those the current widths were
    planned with: some speed differs by more than ``tolerance`` of the planned one, speeds
    below ``tolerance`` compared in absolute terms (a rank near no width moves few columns).

    Comparing planning speeds rather than measured ones also re-plans when only the fixed
    fraction moved: widths planned before the first move's fit (calibrated 0.05, fitted 0.25
    to 0.35 on the bench's emulated devices) give a slow rank too much."""
    return any(
        abs(a - b) > tolerance * max(b, tolerance)
        for a, b in zip(target, planned_with, strict=True)
    )


def model_times(
    speeds: Sequence[float],
    widths: Mapping[str, Sequence[int]],
    fixed_fraction: float,
    compute: Mapping[str, float] | None = None,
) -> tuple[float, ...]:
    """Per rank, the work model's time at ``widths`` on devices at relative ``speeds``:
    ``work_units / speed`` (units of an even split's work on the fastest device)."""
    units = work_units(shares_of(widths, len(speeds), compute), fixed_fraction)
    return tuple(u / max(v, MIN_PLANNING_SPEED) for u, v in zip(units, speeds, strict=True))


def segment_time(
    speeds: Sequence[float],
    widths: Mapping[str, Sequence[int]],
    fixed_fraction: float,
    compute: Mapping[str, float] | None = None,
) -> float:
    """The work model per layer kind: a tensor-parallel step waits at every layer's collective
    for that layer's slowest rank, so its time is the sum over width keys of the key's weight
    (``compute[key]`` over the total; every key alike without it) times the slowest rank's
    ``(phi + (1 - phi) n f_ik) / v_i`` (``f_ik`` its fraction of key ``k``; the fixed part
    taken as spread over the layers like the compute). Keys of total 0 are skipped."""
    n, phi = len(speeds), fixed_fraction
    keys = [
        (1.0 if compute is None else compute.get(key, 0.0), counts)
        for key, counts in widths.items()
        if sum(counts) > 0
    ]
    total = sum(weight for weight, _ in keys)
    if total <= 0:
        return max(model_times(speeds, widths, phi, compute))
    return sum(
        weight
        / total
        * max(
            (phi + (1 - phi) * n * c / sum(counts)) / max(v, MIN_PLANNING_SPEED)
            for c, v in zip(counts, speeds, strict=True)
        )
        for weight, counts in keys
    )


def balanced_key(
    counts: Sequence[int],
    speeds: Sequence[float],
    fixed_fraction: float,
    step: int | None = None,
) -> tuple[int, ...]:
    """One width key's split of ``sum(counts)`` that ``segment_time`` rates best: the least
    slowest ``(phi + (1 - phi) n c_i / C) / v_i``. Greedy in units of ``step`` (default: the
    counts' gcd, which a planner's granularity divides), each to the rank whose term after it
    is least (ties to the lower index): optimal for a bottleneck of terms that grow with
    ``c_i``. A rank gets at least one step unless ``counts`` holds a 0 (the planner's floor:
    a model type that may hold no heads, or a key that may be empty)."""
    n, total, phi = len(counts), sum(counts), fixed_fraction
    step = math.gcd(*counts) if step is None else step
    if total <= 0 or step <= 0 or total % step:
        return tuple(counts)
    alloc = [0 if min(counts) == 0 else step] * n

    def term(i: int) -> float:
        share = (alloc[i] + step) / total
        return (phi + (1 - phi) * n * share) / max(speeds[i], MIN_PLANNING_SPEED)

    for _ in range((total - sum(alloc)) // step):
        alloc[min(range(n), key=lambda i: (term(i), i))] += step
    return tuple(alloc)


def best_plan(
    plan: Callable[[tuple[float, ...]], dict[str, tuple[int, ...]]],
    speeds: Sequence[float],
    fixed_fraction: float,
    compute: Mapping[str, float] | None = None,
) -> tuple[dict[str, tuple[int, ...]], tuple[float, ...]]:
    """The planner's widths the work model predicts fastest, and the speeds planned with.

    Candidates: the planner at ``planning_speeds`` for ``fixed_fraction``, for half of it,
    and at the measured speeds, each also with every width key re-split by
    ``balanced_key`` (session 10: the planner balances whole steps, while every layer waits
    for its own slowest rank; in a quiet session-9 run Llama's 2x rank, given no heads, got
    19 of 1024 ffn columns where its ffn layer balanced at 73, and computed 0.057 s against
    the others' 0.088). Ranked by ``segment_time`` (each layer waits for its own slowest
    rank), then by the whole-step model's times sorted slowest first (among plans with the
    same slowest rank, the one that balances the rest best). When one rank's floor binds (a
    4x rank keeps one head), every split of the rest ties in the planner's objective and it
    may return a lopsided one: at planning speeds (1, 0.012, 1, 0.34) ffn (1017, 0, 519, 0);
    in a bench run (1047, 0, 112, 377) with heads (4, 1, 1, 2), whose whole-step maximum was
    the least of the candidates while its layers waited on rank 0 (measured: 12 ms per step
    slower)."""
    phi = min(max(fixed_fraction, 0.0), 0.9)
    tried: dict[tuple[float, ...], None] = dict.fromkeys(
        (planning_speeds(speeds, phi), planning_speeds(speeds, phi / 2), tuple(speeds))
    )
    ranked, plans = [], [plan(candidate) for candidate in tried]
    # One step per key over every candidate: one candidate alone may hold a single nonzero
    # count (a bench run under load planned heads (0, 0, 8, 0): gcd 8).
    steps = {key: math.gcd(*(c for p in plans for c in p.get(key, ()))) for key in plans[0]}
    for index, (candidate, planned) in enumerate(zip(tried, plans, strict=True)):
        split = {k: balanced_key(v, speeds, phi, steps.get(k)) for k, v in planned.items()}
        for order, widths in enumerate((planned, split)):  # the planner's first on a tie
            times = sorted(model_times(speeds, widths, phi, compute), reverse=True)
            rank = (segment_time(speeds, widths, phi, compute), times, order, index)
            ranked.append((*rank, widths, candidate))
    *_, widths, candidate = min(ranked, key=lambda r: r[:4])
    return widths, candidate


def predicted_saving(
    times: Sequence[float],
    old: Mapping[str, Sequence[int]],
    new: Mapping[str, Sequence[int]],
    fixed_fraction: float = 0.0,
    compute: Mapping[str, float] | None = None,
) -> float:
    """Seconds per step saved moving from widths ``old`` to ``new`` (module docstring; width
    keys weighted by ``compute``, see ``detector.shares_of``)."""
    size = len(times)
    before = work_units(shares_of(old, size, compute), fixed_fraction)
    after = work_units(shares_of(new, size, compute), fixed_fraction)
    scaled = [t * b / max(a, MIN_SHARE) for t, a, b in zip(times, before, after, strict=True)]
    return max(times) - max(scaled)


def decide_replan(
    times: Sequence[float],
    current: Mapping[str, Sequence[int]],
    planned: Mapping[str, Sequence[int]],
    *,
    horizon_steps: int,
    move_cost_s: float,
    fixed_fraction: float = 0.0,
    compute: Mapping[str, float] | None = None,
) -> ReplanDecision:
    """Move to ``planned`` when ``saving * horizon_steps > move_cost_s``.

    Args:
        times: per tensor-parallel rank, measured per-step compute seconds.
        current: the widths running now; planned: the planner's widths at measured speeds.
    """
    now = {k: tuple(v) for k, v in current.items()}
    target = {k: tuple(v) for k, v in planned.items()}
    if {k: target.get(k, now[k]) for k in now} == now and set(target) <= set(now):
        return ReplanDecision("none", now, 0.0, "the planner keeps the current widths")
    saving = predicted_saving(times, now, {**now, **target}, fixed_fraction, compute)
    if saving * horizon_steps > move_cost_s:
        reason = f"{saving:.4g} s/step x {horizon_steps} steps > move cost {move_cost_s:.3g} s"
        return ReplanDecision("resize", {**now, **target}, saving, reason)
    reason = f"{saving:.4g} s/step x {horizon_steps} steps <= move cost {move_cost_s:.3g} s"
    return ReplanDecision("none", now, saving, reason)
