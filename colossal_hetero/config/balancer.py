"""The ``balancer`` section of the configuration tree (runtime straggler balancing).

A part of ``config.schema``, kept in its own module for size; documented in
``docs/config.md`` like every other section.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from colossal_hetero.config.fields import require as _require

BalancerMode = Literal["none", "detect", "resize", "migrate", "replan", "semi"]


@dataclass(kw_only=True, slots=True, frozen=True)
class BalancerConfig:
    """Runtime straggler balancing inside tensor-parallel groups (see docs/balancing.md)."""

    mode: BalancerMode = "none"
    """none: off; detect: straggler detector and decision log only; resize: each straggler
    ZERO-resizes its tensor-parallel layers (drops its lowest-priority reduction columns, as
    many as its measured slowdown asks, at most accuracy_budget) until it recovers; migrate:
    each straggler's surplus columns are computed by the unflagged ranks, losslessly; replan:
    re-plan the widths with measured speeds and resize between steps when the gain pays for
    the move; semi: the SEMI cost-benefit policy picks none, resize, migrate, migrate+resize
    or replan per straggler and re-evaluates it at every agreement. With parallel.pp > 1 each
    pipeline stage decides for its own TP groups; replan is refused there and semi picks
    only none, resize, migrate or migrate+resize. Under parallel.tp_mode 2d: detect or
    resize (ZERO-resizing inside the SUMMA steps) only."""

    every: int = 5
    """Steps between agreements: one small all_gather over the world group every this many
    steps, after which every rank holds the same measurements."""

    window: int = 5
    """Most recent steps of compute time each rank reports at an agreement."""

    smoothing: float = 0.5
    """EWMA weight (0, 1] of the newest window's median; 1 = no memory."""

    threshold: float = 0.15
    """A rank is flagged as a straggler when its slowdown exceeds 1 + threshold."""

    release: float = 0.05
    """A flagged rank is released when its slowdown falls below 1 + release (< threshold)."""

    stable_tolerance: float = 0.1
    """Relative change of any rank's slowdown that restarts the stability count; also how far
    the measured planning speeds may drift from those the current widths were planned for
    before a re-plan is considered."""

    stable_steps: int = 10
    """Steps the slowdown vector must stay stable before a re-plan is considered."""

    horizon_steps: int = 200
    """Steps a move's per-step saving is counted over against its one-off cost."""

    fixed_fraction: float = 0.0
    """Fraction [0, 1) of a rank's compute at even widths that does not scale with its widths
    (replicated layers, optimizer, framework overhead); small models have a large one. The
    first guess: every width move's measured times before and after refine it."""

    move_cost_s: float = 1.0
    """Estimated seconds of one re-plan and resize, until a measured one replaces it."""

    accuracy_budget: float = 0.5
    """resize, semi: the largest fraction of a straggler's reduction dimension resize may drop
    (migrate+resize drops this much first)."""

    accuracy_weight: float = 0.5
    """semi: cost of dropping priority mass m, as m times this times the straggler's step."""

    probe_steps: int = 50
    """resize, migrate, semi: while in-layer ops are attached, every this many steps they
    come off for one agreement window, so that the stragglers' raw slowdown is measured again
    (the ops' own overheads can hide a recovery from the measured times)."""

    priority: Literal["magnitude", "change"] = "magnitude"
    """resize, semi: which reduction columns a straggler keeps. magnitude: the largest column
    weight norms; change: the most recent weight change, dropped columns keeping stale scores
    (the ZERO-resizing paper's rule). Under AdamW, change lost 1.42 accuracy points on digits
    and magnitude 0.49 (8 seeds, docs/balancing-ops.md). Both rules serve 1D and 2D layers."""

    freeze_dropped: bool = True
    """resize, semi: the optimizer step leaves a straggler's dropped columns (weights and
    optimizer state) as they were, so momentum and weight decay do not move them while their
    gradient is imputed; when the ops come off, columns that stayed out of the function
    (gradient exactly 0) restart at 0 (weight and first moments; docs/balancing-ops.md, "Return
    of frozen columns"); false lets the optimizer move them."""

    def __post_init__(self) -> None:
        for name in ("every", "window", "stable_steps", "horizon_steps", "probe_steps"):
            value = getattr(self, name)
            _require(value >= 1, name, f"must be >= 1, got {value}")
        _require(0 < self.smoothing <= 1, "smoothing", f"must be in (0, 1], got {self.smoothing}")
        _require(self.threshold > 0, "threshold", f"must be > 0, got {self.threshold}")
        _require(
            0 <= self.release < self.threshold,
            "release",
            f"must be in [0, threshold {self.threshold}), got {self.release}",
        )
        _require(self.stable_tolerance > 0, "stable_tolerance", "must be > 0")
        _require(
            0 <= self.fixed_fraction < 1,
            "fixed_fraction",
            f"must be in [0, 1), got {self.fixed_fraction}",
        )
        _require(self.move_cost_s >= 0, "move_cost_s", f"must be >= 0, got {self.move_cost_s}")
        _require(
            0 <= self.accuracy_budget < 1,
            "accuracy_budget",
            f"must be in [0, 1), got {self.accuracy_budget}",
        )
        _require(self.accuracy_weight >= 0, "accuracy_weight", "must be >= 0")
        _require(
            self.priority in ("magnitude", "change"),
            "priority",
            f"must be magnitude or change, got {self.priority!r}",
        )
        _require(
            isinstance(self.freeze_dropped, bool),
            "freeze_dropped",
            f"must be true or false, got {self.freeze_dropped!r}",
        )
