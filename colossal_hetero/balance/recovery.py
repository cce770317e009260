"""When a straggler left near no scaling work has recovered, pure: its readings at the same
widths, against the slowest it read there or the slowdown it was planned at.

A rank whose ``n * share`` of the scaling work is under ``replan.NEAR_EMPTY`` runs mostly its
fixed part, and its per-unit reading is that part's time over the *fitted* fixed fraction:
its level carries the fit's error (at no scaling work, ``phi_true / phi_fitted`` times its
slowdown), so hysteresis on the level may never release it. In a quiet session-9 run GPT-2's
4x rank, left with no heads, read 1.32-1.40 after it recovered (release below 1.1) and kept no
work for the whole recovered phase; in another, the fit read 0.18 against about 0.4 and the
recovered rank read 2.1-2.5 until a move gave it work.

The fit's error is the same for every reading at the same widths and the same fit, so a fall
of the readings there is the device's. ``RecoveryWatch`` keeps, per rank, the slowest reading
since the last move (or change of in-layer ops) and, after a move, the slowdown each flagged
rank left near empty was planned at (a *seed*). A flagged near-empty rank is recovered when
its reading fell to under ``1 / RECOVERY_DROP`` of its slowest at these widths, or to under
``1 / RECOVERY_DROP ** 2`` of its seed and reads at most ``cap`` (the controller's
``1 + 2 * threshold``): a seed compares readings across a move, and with it the fit's error
between the widths before (loaded: hardly any) and after (near empty: up to
``phi_fitted / phi_true``), up to 2 in the runs seen (a fit of 0.4 against 0.2 reads a 2x
rank at 1.2 at 8 of 96 columns: 1.67 under its seed; a recovered 4x rank at 1.4, 2.9 under).
A rank still reading over ``cap`` is slow whatever the fit: a session-10 run under load 14-18
read a still-4x rank at 1.8 against its seed 4.2 (2.33) after a fit pulled up by the load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from colossal_hetero.balance.replan import NEAR_EMPTY, RECOVERY_DROP, reading_drops


def near_empty(shares: Sequence[float]) -> frozenset[int]:
    """The ranks whose ``n * share`` of the scaling work is under ``NEAR_EMPTY``."""
    n = len(shares)
    return frozenset(i for i, x in enumerate(shares) if n * x < NEAR_EMPTY)


def recovered(
    stragglers: Sequence[int],
    shares: Sequence[float],
    drops: Sequence[float],
    seed_drops: Mapping[int, float],
    readings: Sequence[float],
    cap: float,
) -> tuple[int, ...]:
    """The flagged ranks near no scaling work whose reading fell: ``drops[r]`` (slowest at
    these widths over the present reading) at least ``RECOVERY_DROP``, or ``seed_drops[r]``
    (the slowdown planned at the last move over the present reading) at least its square
    with the present reading at most ``cap``."""
    empty = near_empty(shares)

    def seeded(r: int) -> bool:
        return seed_drops.get(r, 0.0) >= RECOVERY_DROP**2 and readings[r] <= cap

    return tuple(r for r in stragglers if r in empty and (drops[r] >= RECOVERY_DROP or seeded(r)))


@dataclass
class RecoveryWatch:
    """The readings (``replan.measurable_slowdown``) recorded at the present widths."""

    slowest: dict[int, float] = field(default_factory=dict)
    """Per rank, the slowest reading at these widths (``replan.reading_drops``)."""
    seeds: dict[int, float] = field(default_factory=dict)
    """Per flagged rank moved to near-empty widths, the slowdown it was planned at."""

    def restart(self, seeds: Mapping[int, float] | None = None) -> None:
        """New widths or in-layer ops: forget the readings, keep ``seeds`` (after a move)."""
        self.slowest, self.seeds = {}, dict(seeds or {})

    def update(
        self,
        readings: Sequence[float],
        shares: Sequence[float],
        stragglers: Sequence[int],
        cap: float,
    ) -> tuple[int, ...]:
        """Record ``readings`` and return the flagged ranks that recovered (``recovered``)."""
        self.slowest, drops = reading_drops(self.slowest, readings)
        seed_drops = {r: s / readings[r] for r, s in self.seeds.items() if readings[r] > 0}
        return recovered(stragglers, shares, drops, seed_drops, readings, cap)


def seeds_of(
    speeds: Sequence[float], shares: Sequence[float], stragglers: Sequence[int]
) -> dict[int, float]:
    """The seeds after a move to widths with these ``shares``: each flagged rank near empty
    there, at ``1 / speed`` of the speed it was planned at."""
    empty = near_empty(shares)
    return {r: 1.0 / speeds[r] for r in stragglers if r in empty and speeds[r] > 0}
