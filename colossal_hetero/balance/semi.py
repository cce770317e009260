"""The SEMI policy, pure: per straggler none, resize, migrate, migrate+resize, or a re-plan.

No torch, no torch.distributed. Every rank evaluates it on the same agreed inputs and gets the
same decision. The rule is the digest's A.7 rule (research/seeds_hetero_tp.md; the paper's own
formula was not found), with a group-wide re-plan added as one more candidate. It is a tunable
policy, not a derived optimum.

Model, per tensor-parallel group, from measured per-step compute times ``t_i`` and work shares:

- ``T = min_j t_j`` (the fastest rank's step); straggler ``i`` has ``s_i = t_i / T`` and must
  shed ``f_i = 1 - 1/s_i`` of its work to reach ``T``.
- **resize** (ZERO-resizing) drops ``f_i`` of its reduction dimension: ``t_i - T`` saved per
  step, no communication, an accuracy cost ``lambda * mass(f_i) * t_i`` where ``mass`` is the
  dropped priority mass (uniform priorities: ``mass(f) = f``). Only when ``f_i <= f_max``.
- **migrate** moves ``f_i`` of its work to the ``h`` non-straggler helpers, losslessly: each
  helper gains ``f_i * w_i / h`` (``w_i``: the straggler's work timed on the fastest device)
  plus ``C(f) = (2 f W_i + A) / bandwidth`` (weights sent once and weight gradients returned,
  ``W_i`` the straggler's shard bytes; ``A`` the activation and output-gradient bytes).
- **migrate+resize** resizes by ``f_max`` and migrates the rest (``f_i > f_max`` only).
- **replan** re-splits the widths in proportion to measured speed: every rank then takes
  ``tau = 1 / sum_j(share_j / t_j)``; it saves ``max t - tau`` per step for a one-off cost.

Rule (per straggler): ``s <= 1 + threshold``: none. ``f <= f_max`` and resize's gain minus its
accuracy cost >= migrate's gain: resize. Otherwise migrate or migrate+resize (the larger
gain) when migration is possible (a helper and bandwidth > 0), else resize capped at
``f_max``. Then the group's in-layer plan (all stragglers' choices, helpers' loads summed) is
compared, over ``horizon_steps``, with a re-plan that costs ``replan_cost_s`` once (unless
``SemiSettings.replan`` is False: under pipeline stages only the in-layer actions are candidates).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

IN_LAYER = ("resize", "migrate", "migrate+resize")
"""Actions that need the in-layer ops (ZERO-resizing, migration)."""


@dataclass(frozen=True, slots=True)
class SemiSettings:
    """Knobs of the policy (``config.schema.BalancerConfig`` carries the user-facing ones)."""

    threshold: float = 0.15
    accuracy_budget: float = 0.5
    """f_max: the largest fraction resize may drop."""
    accuracy_weight: float = 0.5
    """lambda: dropping mass m costs ``lambda * m * t_i`` seconds per step."""
    horizon_steps: int = 200
    replan_cost_s: float = 1.0
    """One-off seconds of a re-plan and resize (inf: never re-plan)."""
    replan: bool = True
    """Whether a re-plan is a candidate at all (False under pipeline stages, which the planner
    does not re-plan: the choice is among the in-layer actions, ``replan_value`` -inf)."""

    @classmethod
    def of(cls, config: Any, replan_cost_s: float, replan: bool = True) -> SemiSettings:
        """From a ``BalancerConfig``, the measured move cost and whether a re-plan is possible."""
        return cls(
            threshold=config.threshold,
            accuracy_budget=config.accuracy_budget,
            accuracy_weight=config.accuracy_weight,
            horizon_steps=config.horizon_steps,
            replan_cost_s=replan_cost_s,
            replan=replan,
        )


@dataclass(frozen=True, slots=True)
class SemiInputs:
    """Agreed measurements of one tensor-parallel group."""

    times: tuple[float, ...]
    """Per rank, its per-step compute seconds (outside collectives)."""
    shares: tuple[float, ...]
    """Per rank, its share of the group's work (sums to 1)."""
    bandwidth: float
    """Bytes per second a migration's transfers get (0: none, inf: free)."""
    weight_bytes: tuple[float, ...]
    """Per rank, bytes of its tensor-parallel weight shard."""
    activation_bytes: float = 0.0
    """Per migrating straggler per step: bytes of its layer outputs and output gradients."""
    priorities: tuple[tuple[float, ...], ...] | None = None
    """Per rank, priority scores of its reduction columns (None: uniform)."""

    @classmethod
    def of(
        cls, positions: Sequence[Any], bandwidth: float, shares: tuple[float, ...], times: Any
    ) -> SemiInputs:
        """From the agreed report per position (``window.Report``: weight and all-reduce
        bytes), the agreed bandwidth, the shares and the times to decide from."""
        return cls(
            times=tuple(times),
            shares=shares,
            bandwidth=bandwidth,
            weight_bytes=tuple(r.weight_bytes for r in positions),
            activation_bytes=max(r.allreduce_bytes for r in positions),
        )


@dataclass(frozen=True, slots=True)
class Choice:
    """One straggler's action."""

    rank: int
    action: str
    """resize, migrate or migrate+resize."""
    resized: float
    """Fraction of its reduction dimension dropped."""
    migrated: float
    """Fraction of its work moved to helpers."""
    gain: float
    """Predicted seconds saved per step, this straggler alone, net of the accuracy cost."""


@dataclass(frozen=True, slots=True)
class SemiDecision:
    """The group's decision."""

    action: str
    """none, in_layer (the choices), or replan."""
    choices: tuple[Choice, ...]
    predicted_times: tuple[float, ...]
    """Per rank, predicted per-step compute after the action."""
    predicted_gain: float
    """Predicted seconds saved per step (accuracy cost subtracted for resize)."""
    in_layer_value: float
    """Seconds saved over the horizon by the in-layer plan."""
    replan_value: float
    """Seconds saved over the horizon by a re-plan, its one-off cost subtracted."""
    shed: dict[int, float] = field(default_factory=dict)
    """Per straggler, the fraction of its work resized plus migrated."""


GAIN_TOLERANCE = 1e-9
"""Relative to the slowest rank's time: a straggler's predicted net gain at or below this
is none. Resizing at ``accuracy_weight`` 1 with uniform priorities nets exactly 0, which
floating point can leave at +7e-18 s."""


def gains_nothing(choice: Choice, times: Sequence[float]) -> bool:
    """Whether ``choice``'s net gain is not positive beyond rounding (``GAIN_TOLERANCE``)."""
    return choice.gain <= GAIN_TOLERANCE * max(times)


def bridge_pays(wait: int, semi: SemiDecision, every: int, window: int, horizon_steps: int) -> bool:
    """Whether an in-layer bridge pays while a re-plan waits ``wait`` more steps for
    stability.

    It runs from the next step to the agreement that re-plans, less its warm-up step,
    saving the in-layer gain per step; attaching it restarts the window, so when the next
    agreement would hold under two steps (``every - 1``) it decides nothing and the
    re-plan, and its larger gain, come ``every`` steps later. A re-plan that waits on
    anything but stability (a move that does not pay, the planner) leaves the bridge."""
    if wait <= 0 or semi.action != "replan":
        return True
    bridged = -(-wait // every) * every - 1
    delay = every if every - 1 < min(window, 2) else 0
    in_layer_gain = semi.in_layer_value / max(horizon_steps, 1)
    return in_layer_gain * bridged > semi.predicted_gain * delay


def dropped_mass(fraction: float, scores: Sequence[float] | None) -> float:
    """Priority mass dropped when the lowest-scored ``fraction`` of columns go: uniform ->
    ``fraction``; else the smallest ``floor(fraction * K)`` scores over the total."""
    if scores is None or not scores:
        return fraction
    total = sum(scores)
    k = math.floor(fraction * len(scores) + 1e-9)  # 1e-9: fractions like 1/2 of 8 are exact
    return sum(sorted(scores)[:k]) / total if total > 0 else fraction


def comm_time(fraction: float, rank: int, inputs: SemiInputs) -> float:
    """Seconds per step the migration of ``fraction`` of ``rank``'s work adds (see module)."""
    if fraction <= 0:
        return 0.0
    if inputs.bandwidth <= 0:
        return math.inf
    if math.isinf(inputs.bandwidth):
        return 0.0
    volume = 2 * fraction * inputs.weight_bytes[rank] + inputs.activation_bytes
    return volume / inputs.bandwidth


def choose_straggler(
    rank: int, inputs: SemiInputs, helpers: int, settings: SemiSettings
) -> Choice | None:
    """The A.7 rule for one rank; None when it is not a straggler (``s <= 1 + threshold``)."""
    times = inputs.times
    fast, t = min(times), times[rank]
    if fast <= 0 or t / fast <= 1 + settings.threshold:
        return None
    f, f_max, lam = 1 - fast / t, settings.accuracy_budget, settings.accuracy_weight
    scores = inputs.priorities[rank] if inputs.priorities is not None else None
    # The straggler's work timed on the fastest device (time per unit of work x its share).
    unit = min(ti / max(si, 1e-12) for ti, si in zip(times, inputs.shares, strict=True))
    work = unit * inputs.shares[rank]

    def migrate_gain(moved: float) -> float:
        if helpers == 0:
            return -math.inf
        return (t - fast) - (moved * work / helpers + comm_time(moved, rank, inputs))

    resize_gain = (t - fast) - lam * dropped_mass(f, scores) * t
    mig = migrate_gain(f)
    if f <= f_max and resize_gain >= mig:
        return Choice(rank, "resize", f, 0.0, resize_gain)
    if helpers > 0 and inputs.bandwidth > 0:
        mixed = migrate_gain(f - f_max) - lam * dropped_mass(f_max, scores) * t
        if f > f_max and mixed > mig:
            return Choice(rank, "migrate+resize", f_max, f - f_max, mixed)
        return Choice(rank, "migrate", 0.0, f, mig)
    capped = min(f, f_max)  # no migration possible: resize as far as the budget allows
    gain = (t - t * (1 - capped)) - lam * dropped_mass(capped, scores) * t
    return Choice(rank, "resize", capped, 0.0, gain)


def decide(inputs: SemiInputs, settings: SemiSettings) -> SemiDecision:
    """The group's decision: the per-straggler choices, their combined prediction, and a
    re-plan compared over ``settings.horizon_steps``."""
    times, n = inputs.times, len(inputs.times)
    picks = [choose_straggler(r, inputs, 0, settings) for r in range(n)]
    helpers = sum(p is None for p in picks)
    choices = tuple(
        c for r in range(n) if (c := choose_straggler(r, inputs, helpers, settings)) is not None
    )
    now = max(times)
    if not choices:
        return SemiDecision("none", (), tuple(times), 0.0, 0.0, 0.0)
    predicted, penalty = _in_layer_times(choices, inputs, helpers, settings)
    in_layer_gain = now - max(predicted) - penalty
    tau = 1.0 / sum(share / t for share, t in zip(inputs.shares, times, strict=True) if t > 0)
    horizon = settings.horizon_steps
    replan_value = horizon * (now - tau) - settings.replan_cost_s if settings.replan else -math.inf
    in_layer_value = horizon * in_layer_gain
    shed = {c.rank: c.resized + c.migrated for c in choices}
    if replan_value > in_layer_value and replan_value > 0:
        return SemiDecision(
            "replan", choices, (tau,) * n, now - tau, in_layer_value, replan_value, shed
        )
    return SemiDecision(
        "in_layer", choices, predicted, in_layer_gain, in_layer_value, replan_value, shed
    )


def _in_layer_times(
    choices: Sequence[Choice], inputs: SemiInputs, helpers: int, settings: SemiSettings
) -> tuple[tuple[float, ...], float]:
    """Per rank predicted compute under ``choices`` and the summed accuracy cost per step."""
    times = inputs.times
    fast = min(times)
    unit = min(t / max(s, 1e-12) for t, s in zip(times, inputs.shares, strict=True))
    out, extra, penalty = list(times), 0.0, 0.0
    for c in choices:
        t = times[c.rank]
        out[c.rank] = max(fast, t * (1 - c.resized - c.migrated))
        scores = inputs.priorities[c.rank] if inputs.priorities is not None else None
        penalty += settings.accuracy_weight * dropped_mass(c.resized, scores) * t
        if c.migrated > 0:
            work = unit * inputs.shares[c.rank]
            extra += c.migrated * work / helpers + comm_time(c.migrated, c.rank, inputs)
    strag = {c.rank for c in choices}
    out = [v if r in strag else v + extra / 1.0 for r, v in enumerate(out)]
    return tuple(out), penalty
