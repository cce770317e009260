"""Ada's check of the simulator's choice against measured step times. Pure (no torch).

The simulator predicts every candidate ``k`` from a profile measured at the running ``k``, and
that is where it errs most: a shaped link's token bucket, first messages queued behind the
running ``k``'s bursts and compute that depends on ``k`` all change with ``k`` and are measured
only at the running one (PP=4 on free 20 Mbit/s links: ``k = 3`` predicted level with ``k = 2``
ran 10-15% slower). The step time ada measured at each ``k`` it ran does not have that error.
:class:`MeasuredGuard` keeps the last measured step time of each ``k`` (the agreed slowest rank's
schedule time, so the same on every rank). A measurement is *recent* for ``memory`` retunings,
and *comparable* with the running ``k``'s when the two differ by less than the factor
``comparable``: a larger difference is taken for a change of conditions (a tenant came or
went), not of ``k``. Measured times count as different only beyond ``margin`` (one step's
noise: on the shared 2-core host, steps of one ``k`` moved 5-10% round to round). At each
retuning, in this order:

1. **After an exploration** (rule 3 ran ``k`` for one period in place of ``base``): keep the
   explored ``k`` if it measured more than ``margin`` faster than ``base``'s comparable
   measurement, else go back to ``base``.
2. **A switch the measurements refute is not made**: when the simulator proposes another ``k``
   whose recent comparable measurement is more than ``margin`` slower than the running
   ``k``'s, the running ``k`` stays.
3. **Exploration**: when the simulator keeps the running ``k``, a neighbour ``k ± 1`` that fits
   the memory budget, has no recent measurement and is predicted within ``explore`` of the
   running ``k`` (the simulator cannot tell them apart) runs for one period (the one predicted
   faster; the smaller on a tie). It costs at most one period per neighbour every ``memory``
   retunings, at a ``k`` predicted at most ``explore`` slower.

A comparable measurement from before a change of conditions can still mislead rules 1-2 until
it expires. Not a rule: going back to a ``k`` that measured faster when the simulator keeps the
running one (tried: on PP=2 x TP=2 a tenant costs 15-30%, within any ratio that still lets
``k``'s own 10-20% count, and it moved ada to ``k = 1`` under the tenant).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class MeasuredGuard:
    """The measured-time rules above; the state is a function of the decisions' inputs only."""

    margin: float
    """Measured step times closer than this fraction do not count as different."""
    explore: float
    """Largest predicted slowdown of a neighbour worth one exploratory period."""
    memory: int = 8
    """Retunings a measurement stays recent."""
    comparable: float = 1.25
    """Largest ratio of two step times still compared as measurements of one condition."""
    times: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Per ``k``: (retuning index, measured step seconds) of its last measurement."""
    explored_from: int | None = None
    """The ``k`` an exploration left, until rule 1 has judged it."""

    def __post_init__(self) -> None:
        if self.margin < 0 or self.explore < 0:
            raise ValueError("margin, explore: fractions must be >= 0")
        if self.memory < 2:  # rule 1 compares with the retuning before
            raise ValueError(f"memory: must be >= 2 retunings, got {self.memory}")
        if self.comparable < 1:
            raise ValueError(f"comparable: a ratio >= 1, got {self.comparable}")

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
        comparable = {
            k: s
            for k, s in recent.items()
            if k in predicted and max(s, measured_s) < self.comparable * min(s, measured_s)
        }
        if self.explored_from is not None:
            base, self.explored_from = self.explored_from, None
            if base in predicted and measured_s >= comparable.get(base, 0.0) * (1 - self.margin):
                return base, "explored-back"
            return self._refute(
                running, measured_s, proposed, comparable, predicted, "explored-kept"
            )
        if proposed != running:
            return self._refute(running, measured_s, proposed, comparable, predicted, "model")
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

    def _refute(
        self,
        running: int,
        measured_s: float,
        proposed: int,
        comparable: Mapping[int, float],
        predicted: Mapping[int, float],
        reason: str,
    ) -> tuple[int, str]:
        """Rule 2: the running ``k`` (with ``reason``) unless the proposal stands."""
        if proposed == running:
            return running, reason
        measured = comparable.get(proposed)
        slower = measured is not None and measured > measured_s * (1 + self.margin)
        if slower and running in predicted:
            return running, "explored-kept" if reason == "explored-kept" else "refuted"
        return proposed, "model"
