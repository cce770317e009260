"""In-layer plans, pure: which straggler drops or migrates how much of its reduction columns.

No torch, no torch.distributed. Every rank computes the same plan from the same agreed
slowdown vector, so the layer ops attached from it (balance/actuator.py) match on every rank.

Work model (the detector's, balance/detector.py): at widths with shares ``share_i`` rank i
does ``U_i = phi + G_i`` units of work, ``G_i = (1 - phi) * n * share_i`` of them in the
resizable GEMMs (``phi``: ``balancer.fixed_fraction``). Its device takes ``s_i`` (the
agreed slowdown) seconds-per-unit relative to the fastest device. A straggler r that drops
``d_r`` and migrates ``m_r`` of its reduction columns runs ``U_r - G_r (d_r + m_r)`` units;
each of the H helpers (the unflagged ranks) gains ``sum_r G_r m_r / H``.

Amounts, chosen so that every busy rank finishes at one time T:

- resize only: ``T`` is the fastest rank's time ``min_j s_j U_j``, and
  ``d_r = (U_r - T / s_r) / G_r`` capped at the accuracy budget (equal shares: the ops'
  ``kept_fraction`` with ``gemm_share = 1 - phi``);
- with migration: the helpers (mean slowdown ``s_h``, mean units ``U_h``) and the migrating
  stragglers meet at ``T = (s_h U_h + s_h A / H) / (1 + s_h B / H)`` with
  ``A = sum_r (U_r - G_r d_r)`` and ``B = sum_r 1 / s_r``; then
  ``m_r = (U_r - G_r d_r - T / s_r) / G_r`` (one straggler, equal shares: the ops'
  ``migrated_fraction`` with ``g = 1 - phi``); resize-only stragglers aim at the same T.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

IN_LAYER_ACTIONS = ("resize", "migrate", "migrate+resize")


@dataclass(frozen=True, slots=True)
class Offload:
    """One straggler's in-layer action."""

    rank: int
    """Its tensor-parallel position."""
    action: str
    """resize, migrate or migrate+resize."""
    dropped: float
    """Fraction of its reduction columns ZERO-resized (not computed, gradients imputed)."""
    migrated: float
    """Fraction of its reduction columns computed by the helpers."""
    slowdown: float
    """The agreed slowdown the amounts were computed for."""


@dataclass(frozen=True, slots=True)
class InLayerPlan:
    """The in-layer ops of one tensor-parallel group (the same in every group)."""

    offloads: tuple[Offload, ...] = ()
    helpers: tuple[int, ...] = ()
    """Positions that take migrated columns (the unflagged ranks), ascending."""

    def of(self, rank: int) -> Offload | None:
        """``rank``'s offload, None when it runs its layers in full."""
        return next((o for o in self.offloads if o.rank == rank), None)

    @property
    def empty(self) -> bool:
        return not self.offloads

    @property
    def migrating(self) -> tuple[Offload, ...]:
        return tuple(o for o in self.offloads if o.migrated > 0)

    def actions(self) -> dict[int, str]:
        return {o.rank: o.action for o in self.offloads}

    def same_as(self, other: InLayerPlan, tolerance: float) -> bool:
        """Same ranks and actions, and every slowdown within ``tolerance`` (relative): no
        reason to re-attach ops (hysteresis on the amounts)."""
        if self.actions() != other.actions() or self.helpers != other.helpers:
            return False
        return all(
            abs(a.slowdown - other_offload.slowdown) <= tolerance * other_offload.slowdown
            for a in self.offloads
            if (other_offload := other.of(a.rank)) is not None
        )

    def record(self) -> dict[str, object]:
        """The plan for a decision record."""
        return {
            "offloads": [
                {
                    "rank": o.rank,
                    "action": o.action,
                    "dropped": round(o.dropped, 4),
                    "migrated": round(o.migrated, 4),
                    "slowdown": round(o.slowdown, 4),
                }
                for o in self.offloads
            ],
            "helpers": list(self.helpers),
        }


def gemm_units(shares: Sequence[float], fixed_fraction: float) -> tuple[float, ...]:
    """Per rank, ``G_i``: its units of work in the resizable GEMMs."""
    n = len(shares)
    return tuple((1 - fixed_fraction) * n * share for share in shares)


def plan_units(
    plan: InLayerPlan, shares: Sequence[float], fixed_fraction: float
) -> tuple[float, ...]:
    """Per rank, its units of work under ``plan`` (``detector.work_units`` when empty)."""
    gemm = gemm_units(shares, fixed_fraction)
    units = [fixed_fraction + g for g in gemm]
    moved = 0.0
    for o in plan.offloads:
        units[o.rank] -= gemm[o.rank] * (o.dropped + o.migrated)
        moved += gemm[o.rank] * o.migrated
    for h in plan.helpers:
        units[h] += moved / len(plan.helpers)
    return tuple(units)


def plan_offloads(
    actions: Mapping[int, str],
    slowdown: Sequence[float],
    shares: Sequence[float],
    *,
    fixed_fraction: float,
    budget: float,
) -> InLayerPlan:
    """Amounts for ``actions`` (position -> resize | migrate | migrate+resize) at the agreed
    ``slowdown`` (see the module docstring). Helpers are the positions without an action;
    without a helper a migrate degrades to nothing (there is nobody to take the work).

    ``budget``: the largest fraction of a rank's columns ZERO-resizing may drop.
    """
    n = len(slowdown)
    gemm = gemm_units(shares, fixed_fraction)
    units = [fixed_fraction + g for g in gemm]
    helpers = tuple(r for r in range(n) if r not in actions)
    drop = {r: (budget if a == "migrate+resize" else 0.0) for r, a in actions.items()}
    movers = [r for r, a in actions.items() if a != "resize" and helpers and gemm[r] > 0]
    target = min(slowdown[r] * units[r] for r in range(n))
    if movers:
        s_h = sum(slowdown[h] for h in helpers) / len(helpers)
        u_h = sum(units[h] for h in helpers) / len(helpers)
        a_sum = sum(units[r] - gemm[r] * drop[r] for r in movers)
        b_sum = sum(1.0 / slowdown[r] for r in movers)
        big_h = len(helpers)
        target = (s_h * u_h + s_h * a_sum / big_h) / (1 + s_h * b_sum / big_h)
    offloads = []
    for r in sorted(actions):
        if gemm[r] <= 0:
            continue
        if r in movers:
            left = 1.0 - drop[r]
            moved = _clip((units[r] - gemm[r] * drop[r] - target / slowdown[r]) / gemm[r], left)
            if moved > 0 or drop[r] > 0:
                offloads.append(Offload(r, actions[r], drop[r], moved, slowdown[r]))
            continue
        if actions[r] != "resize" and not helpers:
            continue  # a migration with nobody to migrate to
        dropped = _clip((units[r] - target / slowdown[r]) / gemm[r], budget)
        if dropped > 0:
            offloads.append(Offload(r, "resize", dropped, 0.0, slowdown[r]))
    used = helpers if any(o.migrated > 0 for o in offloads) else ()
    return InLayerPlan(tuple(offloads), used)


def _clip(value: float, high: float) -> float:
    return min(max(value, 0.0), high)


def predicted_times(
    times: Sequence[float],
    now: InLayerPlan,
    new: InLayerPlan,
    shares: Sequence[float],
    fixed_fraction: float,
) -> tuple[float, ...]:
    """Per rank, its compute under ``new`` predicted from ``times`` measured under ``now``:
    each rank keeps its measured seconds per unit of work."""
    before = plan_units(now, shares, fixed_fraction)
    after = plan_units(new, shares, fixed_fraction)
    return tuple(t / max(b, 1e-12) * a for t, b, a in zip(times, before, after, strict=True))


def effective_slowdown(
    plan: InLayerPlan,
    slowdown: Sequence[float],
    flagged: Sequence[int],
    times: Sequence[float],
    *,
    release: float,
    budget: float,
) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """The slowdown vector and stragglers to plan from while ``plan`` is attached.

    The work model can be off (a step's fixed part, the ops' own overhead), and then the
    per-unit slowdown of a rank whose work the ops cut drifts, which would feed back into
    ever larger cuts. So an offloaded rank's slowdown is corrected by what the ops achieved
    instead: ``s' = s_planned * t_r / t_ref``, ``t_ref`` the slowest rank neither offloaded
    nor flagged (a straggler flagged since the plan was made is no reference: next to its
    time every offloaded rank would read as recovered; with no such rank, the slowest rank
    without an offload) -- integral control: the amounts settle where the measured times
    meet, whatever the model.
    A rank whose cut is at its cap and still lags keeps ``s_planned`` (nothing more to do);
    one that is ahead takes the lower of ``s'`` and the detector's value (a recovery shows
    at once where the work model holds). It stays a straggler while ``s' >= 1 + release``
    and the detector still flags it: the detector reads its time per unit of work under the
    ops (with the controller's fitted ``ops_fraction``), so its release is a recovery even
    where the ops' overheads keep the rank behind the others; then the rank takes the lower
    of ``s'`` and the detector's value. The other ranks keep the detector's value and flags.
    """
    out, stragglers = list(slowdown), {r for r in flagged if plan.of(r) is None}
    free = [r for r in range(len(times)) if plan.of(r) is None]
    others = [times[r] for r in free if r not in flagged] or [times[r] for r in free]
    reference = max(others) if others else 0.0
    for o in plan.offloads:
        ratio = times[o.rank] / reference if reference > 0 else 1.0
        capped = o.dropped >= budget - 1e-9 if o.migrated == 0 else o.dropped + o.migrated >= 1
        if ratio > 1:
            value = o.slowdown if capped else o.slowdown * ratio
        else:  # ahead: recovering; the detector's value is taken when it is lower
            value = min(o.slowdown * ratio, slowdown[o.rank])
        if o.rank not in flagged:  # the detector released it: recovered
            value = min(value, slowdown[o.rank])
        out[o.rank] = max(value, 1.0)
        if value >= 1 + release and o.rank in flagged:
            stragglers.add(o.rank)
    return tuple(out), tuple(sorted(stragglers))
