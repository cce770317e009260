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
   ``k``'s, the running ``k`` stays; so it does when that measurement is merely no faster and
   the simulator's predicted gain (per step) is below ``margin`` (session 10: PP=4 moved from
   ``k = 2`` to 3 on a predicted 1.5% that the step measured at 3 had not shown, and ran 3-4%
   slower for the rest of the phase).
3. **Exploration**: when the simulator keeps the running ``k``, a neighbour ``k ± 1`` that fits
   the memory budget, has no recent measurement and is predicted within ``explore`` of the
   running ``k`` (the simulator cannot tell them apart) runs for one period (the one predicted
   faster; the smaller on a tie). It costs at most one period per neighbour every ``memory``
   retunings, at a ``k`` predicted at most ``explore`` slower. It waits until the running ``k``
   has run ``settle`` retunings in a row under comparable conditions (its *streak*).

**A settled time per k** (``settle``): what the guard keeps of the running ``k`` is the median of
its streak's last ``settle`` step times, not its last step. Rule 1 judged an exploration from
one step against one step, each with 5-10% of noise, under a 10% margin: sessions 10-12 explored
20 times and kept none, while each exploration cost a period at a ``k`` predicted up to
``explore`` slower; 7 of them ran at an engine's first or second retuning, against a base
measured once (the first step of a fresh engine, or one under other conditions, which rule 1
can never find comparable). With ``settle = 3`` the base is the median of three steps (one
stray step of the host does not set it) and no exploration runs before it exists.

**Conditions the simulator saw** (``latest``, optional: each ``k``'s predicted seconds from the
newest step's profile alone): a measurement also keeps, as it is taken, the prediction of its
own ``k`` from its own step's profile; when the newest profile predicts that ``k`` more than the
factor ``conditions`` away from it, the conditions changed (slower compute, a slower link) and
the measurement is not comparable. The measured ratio alone let a first step of phase (c) at
``k = 2`` (1.12 s, its own profile predicting 1.15) judge an exploration of ``k = 3`` (0.90 s,
both ``k`` predicted at 0.90 from that step): kept, where ``k = 2`` ran 0.91 and ``k = 3`` 0.95.
A comparable measurement from before a change of conditions can still mislead rules 1-2 until
it expires. Not a rule: going back to a ``k`` that measured faster when the simulator keeps the
running one (tried: on PP=2 x TP=2 a tenant costs 15-30%, within any ratio that still lets
``k``'s own 10-20% count, and it moved ada to ``k = 1`` under the tenant).
"""

from __future__ import annotations

import math
import statistics
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
    conditions: float = 1.15
    """Largest factor between a measured ``k``'s prediction from its own step's profile and from
    the newest one for the measurement to stay comparable (see the module doc)."""
    times: dict[int, tuple[int, float, float | None]] = field(default_factory=dict)
    """Per ``k``: (retuning index, measured step seconds, its prediction from that step's own
    profile or None) of its last measurement."""
    explored_from: int | None = None
    """The ``k`` an exploration left, until rule 1 has judged it."""
    settle: int = 1
    """Retunings in a row the running ``k`` runs before rule 3 explores; its kept time is the
    median of its last ``settle`` comparable ones (1: the last step alone)."""
    streak: list[tuple[float, float | None]] = field(default_factory=list)
    """The running ``k``'s consecutive comparable measurements (seconds, prediction of it from
    its own step's profile), oldest first, at most ``settle``."""
    streak_k: int | None = None
    """The ``k`` of ``streak``."""

    def __post_init__(self) -> None:
        if self.margin < 0 or self.explore < 0:
            raise ValueError("margin, explore: fractions must be >= 0")
        if self.settle < 1:
            raise ValueError(f"settle: must be >= 1 retunings, got {self.settle}")
        if self.memory < 2:  # rule 1 compares with the retuning before
            raise ValueError(f"memory: must be >= 2 retunings, got {self.memory}")
        if self.comparable < 1 or self.conditions < 1:
            raise ValueError(
                f"comparable, conditions: ratios >= 1, got {self.comparable}, {self.conditions}"
            )

    def choose(
        self,
        index: int,
        running: int,
        measured_s: float,
        proposed: int,
        predicted: Mapping[int, float],
        latest: Mapping[int, float] | None = None,
    ) -> tuple[int, str]:
        """The ``k`` for the next period and the rule that chose it.

        ``running`` ran the step measured (``measured_s`` seconds; the rules use its settled
        time, the median of its streak), ``proposed`` is the simulator's choice and
        ``predicted`` its time for every candidate that fits memory (summed over the window).
        ``latest``: each ``k``'s predicted seconds from the measured step's profile alone
        (conditions, see the module doc); None skips that check.
        Reasons: ``"explored-kept"``, ``"explored-back"`` (rule 1), ``"refuted"`` (rule 2),
        ``"explore"`` (rule 3), ``"model"`` (the simulator's switch), ``"kept"``.
        """
        latest = latest or {}
        steady = self._settled(running, measured_s, latest.get(running))
        self.times[running] = (index, steady, latest.get(running))
        recent = {k: s for k, (i, s, _) in self.times.items() if index - i < self.memory}
        comparable = {
            k: s
            for k, s in recent.items()
            if k in predicted
            and _within(s, steady, self.comparable)
            and self._same_conditions(k, latest)
        }
        if self.explored_from is not None:
            base, self.explored_from = self.explored_from, None
            if base in predicted and steady >= comparable.get(base, 0.0) * (1 - self.margin):
                return base, "explored-back"
            return self._refute(running, steady, proposed, comparable, predicted, "explored-kept")
        if proposed != running:
            return self._refute(running, steady, proposed, comparable, predicted, "model")
        limit = predicted[running] * (1 + self.explore)
        options = [
            k
            for k in (running - 1, running + 1)
            if k in predicted and k not in recent and predicted[k] <= limit
        ]
        if not options or len(self.streak) < self.settle:
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
        gain = predicted[running] / predicted[proposed] - 1 if running in predicted else math.inf
        slower = measured is not None and (
            measured > measured_s * (1 + self.margin)
            or (measured >= measured_s and gain < self.margin)
        )
        if slower and running in predicted:
            return running, "explored-kept" if reason == "explored-kept" else "refuted"
        return proposed, "model"

    def _settled(self, running: int, measured_s: float, own: float | None) -> float:
        """Add this measurement to the running ``k``'s streak (a new streak when ``k`` changed
        or the step is not comparable with the streak's last: ratio ``comparable``, own
        predictions ``conditions``); the median of the streak."""
        if self.streak_k == running and self.streak:
            last_s, last_own = self.streak[-1]
            same = _within(last_s, measured_s, self.comparable) and (
                last_own is None or own is None or _within(last_own, own, self.conditions)
            )
        else:
            same = False
        kept = self.streak[1 - self.settle :] if same and self.settle > 1 else []
        self.streak, self.streak_k = [*kept, (measured_s, own)], running
        return statistics.median(s for s, _ in self.streak)

    def _same_conditions(self, k: int, latest: Mapping[int, float]) -> bool:
        """Whether ``k``'s measurement was taken under the conditions of the newest profile:
        its own step's prediction of ``k`` within ``conditions`` of the newest one's (True when
        either is unknown)."""
        then, now = self.times[k][2], latest.get(k)
        return then is None or now is None or _within(then, now, self.conditions)


def _within(a: float, b: float, factor: float) -> bool:
    """Whether ``a`` and ``b`` differ by less than ``factor``."""
    return max(a, b) < factor * min(a, b)
