"""Ada's check of the simulator's choice against measured step times. Pure (no torch).

The simulator predicts every candidate ``k`` from a profile measured at the running ``k``, and
that is where it errs most: a shaped link's token bucket, first messages queued behind the
running ``k``'s bursts and compute that depends on ``k`` all change with ``k`` and are measured
only at the running one (PP=4 on free 20 Mbit/s links: ``k = 3`` predicted level with ``k = 2``
ran 10-15% slower). The step time ada measured at each ``k`` it ran does not have that error.
:class:`MeasuredGuard` keeps the last measured step time of each ``k`` (the agreed slowest rank's
schedule time, so the same on every rank) and applies three rules, in this order, at each
retuning (``index`` counts retunings; a measurement is *recent* for ``memory`` retunings):

1. **After an exploration** (rule 3 ran ``k`` for one retuning period in place of ``base``):
   keep the explored ``k`` if it measured at least ``min_gain`` faster than ``base``'s recent
   measurement, else go back to ``base``.
2. **A switch the measurements refute is not made**: when the simulator proposes a ``k`` other
   than the running one and that ``k`` has a recent measurement more than ``min_gain`` slower
   than the running ``k``'s, the running ``k`` stays.
3. **Exploration**: when the simulator keeps the running ``k``, a neighbour ``k ± 1`` that fits
   the memory budget, has no recent measurement and is predicted within ``explore`` of the
   running ``k`` (the simulator cannot tell them apart) runs for one period (the one predicted
   faster; the smaller on a tie). It costs at most one period per neighbour every ``memory``
   retunings, at a ``k`` predicted at most ``explore`` slower.

Measurements taken under other conditions (a tenant came or went) can mislead rules 1 and 2 for
at most ``memory`` retunings; the simulator's proposal is followed again after that.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class MeasuredGuard:
    """The measured-time rules above; the state is a function of the decisions' inputs only."""

    min_gain: float
    """Measured step times closer than this fraction do not count as different."""
    explore: float
    """Largest predicted slowdown of a neighbour worth one exploratory period."""
    memory: int = 8
    """Retunings a measurement stays recent."""
    times: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Per ``k``: (retuning index, measured step seconds) of its last measurement."""
    explored_from: int | None = None
    """The ``k`` an exploration left, until rule 1 has judged it."""

    def __post_init__(self) -> None:
        if self.min_gain < 0 or self.explore < 0:
            raise ValueError("min_gain, explore: fractions must be >= 0")
        if self.memory < 2:  # rule 1 compares with the retuning before
            raise ValueError(
                f"memory: measurements must stay recent >= 2 retunings, got {self.memory}"
            )

    def choose(
        self,
        index: int,
        running: int,
        measured_s: float,
        proposed: int,
        predicted: Mapping[int, float],
    ) -> tuple[int, str]:
        """The ``k`` for the next period and the rule that chose it.

        ``running`` ran the step measured (``measured_s`` seconds), ``proposed`` is the
        simulator's choice and ``predicted`` its time for every candidate that fits memory.
        Reasons: ``"explored-kept"``, ``"explored-back"`` (rule 1), ``"refuted"`` (rule 2),
        ``"explore"`` (rule 3), ``"model"`` (the simulator's switch), ``"kept"``.
        """
        self.times[running] = (index, measured_s)
        recent = {k: s for k, (i, s) in self.times.items() if index - i < self.memory}
        reason = ""
        if self.explored_from is not None:
            base, self.explored_from = self.explored_from, None
            if base in predicted and base in recent:
                if measured_s > recent[base] * (1 - self.min_gain):
                    return base, "explored-back"
                reason = "explored-kept"
        if proposed != running:
            refuted = proposed in recent and recent[proposed] > measured_s * (1 + self.min_gain)
            if refuted and running in predicted:
                return running, reason or "refuted"
            return proposed, "model"
        if reason == "explored-kept":
            return running, reason
        limit = predicted[running] * (1 + self.explore)
        options = [
            k
            for k in (running - 1, running + 1)
            if k in predicted and k not in recent and predicted[k] <= limit
        ]
        if not options:
            return running, "kept"
        k = min(options, key=lambda c: (predicted[c], c))
        self.explored_from = running
        return k, "explore"
