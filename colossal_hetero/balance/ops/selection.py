"""Pure math of the balancing ops: how much to keep or migrate, and which columns.

No torch.distributed here: every function is deterministic in its inputs, so every rank that
calls it with the agreed slowdown vector and its replicated scores gets the same answer.

Columns are the K indices of a layer's reduction (input-feature) dimension on one rank.
Priority order: higher score first, ties broken by the lower index (a stable sort).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def kept_fraction(slowdown: float, *, min_fraction: float = 0.5, gemm_share: float = 1.0) -> float:
    """Fraction rho of the reduction dimension a straggler keeps to finish with the fastest rank.

    ``slowdown`` s = t_straggler / t_fastest (measured; s <= 1 keeps everything).
    ``gemm_share`` g: the part of the straggler's layer time that is the resizable GEMMs (their
    time scales with rho; the rest does not). Solving s * (g * rho + 1 - g) = 1 gives
    rho = (1 / s - (1 - g)) / g, clipped to [``min_fraction``, 1] (``min_fraction`` is the
    accuracy budget: the most a layer may drop is 1 - min_fraction).
    """
    if not math.isfinite(slowdown) or slowdown <= 0:
        raise ValueError(f"slowdown must be a finite number > 0, got {slowdown}")
    if not 0 < min_fraction <= 1:
        raise ValueError(f"min_fraction must be in (0, 1], got {min_fraction}")
    if not 0 < gemm_share <= 1:
        raise ValueError(f"gemm_share must be in (0, 1], got {gemm_share}")
    rho = (1.0 / slowdown - (1.0 - gemm_share)) / gemm_share
    return min(1.0, max(min_fraction, rho))


def migrated_fraction(slowdown: float, num_helpers: int) -> float:
    """Fraction f of a straggler's columns to hand to ``num_helpers`` helpers (speed 1).

    The straggler then takes s * (1 - f) and each helper 1 + f / H (its own layer plus its
    share of the straggler's, at equal widths); equal when f = (s - 1) / (s + 1 / H). With
    many helpers this tends to the digest's 1 - 1 / s.
    """
    if not math.isfinite(slowdown) or slowdown <= 0:
        raise ValueError(f"slowdown must be a finite number > 0, got {slowdown}")
    if num_helpers < 1:
        raise ValueError(f"num_helpers must be >= 1, got {num_helpers}")
    if slowdown <= 1:
        return 0.0
    return (slowdown - 1.0) / (slowdown + 1.0 / num_helpers)


def kept_count(num_columns: int, fraction: float) -> int:
    """K - floor(K * (1 - fraction)) columns (the authors' rounding), at least 1 when K >= 1.

    The product is rounded to 9 decimals first so that 1 - 0.9 = 0.0999.. still drops 1 of 10.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"kept fraction must be in (0, 1], got {fraction}")
    dropped = math.floor(round(num_columns * (1.0 - fraction), 9))
    return max(min(num_columns, 1), num_columns - dropped)


def priority_order(scores: torch.Tensor) -> torch.Tensor:
    """Column indices by descending score, ties by ascending index. scores [K] -> LongTensor [K]."""
    return torch.sort(-scores, stable=True).indices


def select_kept(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """The ``kept_count(K, fraction)`` highest-priority columns, sorted ascending (LongTensor)."""
    count = kept_count(scores.numel(), fraction)
    return priority_order(scores)[:count].sort().values


def column_change(weight: torch.Tensor, snapshot: torch.Tensor, dim: int) -> torch.Tensor:
    """v_j = sum over the other dim of |weight - snapshot| for each column j along ``dim``.

    ``dim`` is the reduction dimension in the parameter's storage (1 for nn.Linear's [N, K],
    0 for Conv1D's [K, N]). Returns float64 [K] on the CPU, where the scores live.
    """
    diff = (weight.detach().double() - snapshot.detach().double()).abs()
    return diff.sum(dim=1 - dim).cpu()


def column_norm(weight: torch.Tensor, dim: int) -> torch.Tensor:
    """||W_j||_2 over the other dim for each column j along ``dim`` (float64 [K] on the CPU).

    The ``"magnitude"`` priority: a column's weight norm bounds what dropping it removes from
    the layer's output, ||x_j W_j^T||_F = ||x_j|| ||W_j|| for input feature x_j.
    """
    return weight.detach().double().pow(2).sum(dim=1 - dim).sqrt().cpu()


PRIORITY_RULES = ("change", "magnitude")
"""Scores a :class:`PriorityTracker` keeps (see its docstring)."""


def update_scores(
    scores: torch.Tensor, change: torch.Tensor, computed: torch.Tensor
) -> torch.Tensor:
    """New scores: ``change`` at the columns computed last period, the old (stale) score elsewhere.

    A dropped column's change is ~0 only because it was not trained; keeping its stale score
    lets it win its place back once the kept columns' changes fall below it.
    """
    new = scores.clone()
    new[computed] = change[computed].to(new.dtype)
    return new


@dataclass(frozen=True)
class MigrationSplit:
    """A straggler's columns by role: computed locally, migrated per helper, dropped.

    compute: highest priority; migrated[h]: the next ones, one slice per helper, in helper
    order; dropped: the lowest (ZERO-resized on top of migration). All sorted ascending,
    pairwise disjoint, and together exactly range(K).
    """

    compute: torch.Tensor
    migrated: tuple[torch.Tensor, ...]
    dropped: torch.Tensor


def split_migration(
    scores: torch.Tensor, migrate_count: int, num_helpers: int, drop_count: int = 0
) -> MigrationSplit:
    """Split K = numel(scores) columns into compute | migrated (per helper) | dropped.

    The ``migrate_count`` columns after the kept ones in priority order go to the helpers in
    contiguous chunks whose sizes differ by at most one (earlier helpers get the extra).
    """
    total = scores.numel()
    if num_helpers < 1:
        raise ValueError(f"num_helpers must be >= 1, got {num_helpers}")
    if migrate_count < 0 or drop_count < 0 or migrate_count + drop_count > total:
        raise ValueError(
            f"migrate_count {migrate_count} + drop_count {drop_count} must be in [0, {total}]"
        )
    order = priority_order(scores)
    keep = total - migrate_count - drop_count
    migrated = order[keep : keep + migrate_count]
    base, extra = divmod(migrate_count, num_helpers)
    sizes = [base + (1 if h < extra else 0) for h in range(num_helpers)]
    chunks = tuple(c.sort().values for c in migrated.split(sizes))
    return MigrationSplit(
        order[:keep].sort().values, chunks, order[keep + migrate_count :].sort().values
    )


class PriorityTracker:
    """One layer's priority scores on one rank's weight shard; higher is kept first.

    ``rule="change"`` (the default; the digest's A.4 rule): scores start at ones; ``refresh``
    at each period boundary sets the computed columns' scores to their L1 change since the
    last boundary, keeps the others' stale scores, and snapshots the weight.

    ``rule="magnitude"``: every column's score is its weight norm now (:func:`column_norm`),
    dropped columns included (their weights are local, so no score is stale and no snapshot
    is kept). Under AdamW every trained column moves by about the learning rate per step, so
    the change rule ranks columns almost at random and its stale scores (measured at an
    earlier, higher learning rate) churn the kept set; the norm ranks them by how much of
    the output they carry (docs/balancing-ops.md has the digits measurements).

    Deterministic, so replicated weights give replicated scores. The actuator refreshes it
    at every period boundary whether or not an op is attached (every column computed while
    none is), so that the first kept set of a new straggler is chosen by the scores, not by
    index, and scores outlive a detach.
    """

    def __init__(self, weight: torch.Tensor, dim: int, rule: str = "change") -> None:
        if rule not in PRIORITY_RULES:
            raise ValueError(f"priority rule must be one of {PRIORITY_RULES}, got {rule!r}")
        self.dim, self.rule = dim, rule
        if rule == "magnitude":
            self.scores = column_norm(weight, dim)
            self.snapshot: torch.Tensor | None = None
        else:
            self.scores = torch.ones(weight.shape[dim], dtype=torch.float64)
            self.snapshot = weight.detach().clone()

    def refresh(self, weight: torch.Tensor, computed: torch.Tensor) -> torch.Tensor:
        """Update the scores from ``weight`` now; ``computed`` = columns computed last period
        (the magnitude rule scores every column and ignores it).

        Change rule: a weight whose shape changed (a width move) cannot be compared with the
        snapshot: the scores are kept when its reduction width is unchanged (the columns are
        the same input features; only the output rows moved), reset to ones otherwise, and
        the weight is snapshotted for the next period.
        """
        if self.snapshot is None:
            self.scores = column_norm(weight, self.dim)
            return self.scores
        if weight.shape != self.snapshot.shape:
            if weight.shape[self.dim] != self.scores.numel():
                self.scores = torch.ones(weight.shape[self.dim], dtype=torch.float64)
            self.snapshot = weight.detach().clone()
            return self.scores
        # column_change in place: a temporary the weight's size cost ~25x the arithmetic (CPU).
        # Summed in at least fp32, and in fp64 for fp64 weights (exact tests compare there).
        diff = self.snapshot.sub_(weight.detach()).abs_()
        accumulate = torch.promote_types(diff.dtype, torch.float32)
        change = diff.sum(dim=1 - self.dim, dtype=accumulate).double().cpu()
        self.scores = update_scores(self.scores, change, computed.cpu())
        self.snapshot.copy_(weight.detach())
        return self.scores
