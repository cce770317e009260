"""Measure benchmark variants in interleaved rounds until every ratio is known to +-3%.

Every ``bench`` subcommand drives its variants through :func:`run_rounds`:

- a **variant** is a callable ``variant(index, warmup=...)`` that does one round's work (one
  training step, or a block of steps for benchmarks that interleave in coarser rounds) and
  returns that round's measurement: a float, or a mapping of named floats (``{"step": ...,
  "compute": ...}`` becomes the series ``"NAME.step"`` and ``"NAME.compute"``); a plain float
  becomes the series ``"NAME"``. Warm-up rounds' return values are ignored.
- a **figure** is a callable from one round's values (all series, by name) to a positive
  ratio, e.g. ``lambda v: v["stock.step"] / v["planned.step"]``. Its reported value is the
  median of its per-round values with a paired bootstrap interval (``bench.stats``).

Each round runs every variant once, in a carryover-balanced order (a Williams design,
:func:`round_order`): over every ``n`` rounds (``2n`` for an odd number of variants) each
variant runs first equally often and directly after each other variant equally often. A plain
rotation would put every variant after the same neighbour in every round, and whatever that
neighbour leaves behind (a draining link queue, a cold cache) would bias one ratio.

After ``min_rounds`` rounds the driver asks, once per round, whether to stop:
every figure's interval half-width is <= ``target_half_width`` (converged), or the time
budget or ``max_rounds`` is spent. In a distributed benchmark the question goes through
``decide``, so that every rank runs the same rounds and issues the same collectives:
:func:`rank0_decides` answers on global rank 0 and broadcasts the answer to the world group.
Variants should return rank-identical numbers (e.g. the slowest rank's step time from an
all_gather) so that every rank also reports the same intervals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from colossal_hetero.bench.stats import CONFIDENCE, Interval, median_interval, ratio_interval

Values = float | Mapping[str, float]
Figure = Callable[[Mapping[str, float]], float]
Decide = Callable[[Callable[[], bool]], bool]
"""``decide(propose) -> stop``: calls ``propose()`` where the decision is taken, agrees on it."""


class Variant(Protocol):
    """One round of one variant; returns its measurement (ignored in warm-up rounds)."""

    def __call__(self, index: int, *, warmup: bool) -> Values | None: ...


@dataclass(frozen=True)
class RoundsPolicy:
    """When to stop measuring."""

    warmup: int = 2
    """Unrecorded rounds first (allocator, caches, lazy initialisation)."""
    min_rounds: int = 10
    """Recorded rounds before the first stopping check (the intervals' coverage was checked
    from 10 rounds up)."""
    max_rounds: int = 400
    budget_s: float = 60.0
    """Wall seconds for all rounds, warm-up included; the round under way finishes."""
    target_half_width: float = 0.03
    """Stop once every figure's interval half-width (relative) is at most this."""
    project: bool = False
    """Also stop when the next round would end past ``budget_s`` at the mean round so far
    (warm-up included), so that a time limit holds instead of being overrun by one round."""
    seed: int = 0
    """Bootstrap seed (the same on every rank)."""

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.min_rounds < 2 or self.max_rounds < self.min_rounds:
            raise ValueError(
                f"RoundsPolicy: need warmup >= 0 and 2 <= min_rounds <= max_rounds, got "
                f"{self.warmup}, {self.min_rounds}, {self.max_rounds}"
            )


@dataclass
class RoundsResult:
    """Every recorded round's values, and the intervals computed from them."""

    policy: RoundsPolicy
    series: dict[str, list[float]]
    medians: dict[str, Interval]
    figures: dict[str, Interval]
    figure_series: dict[str, list[float]]
    """Each figure's per-round values."""
    elapsed_s: float

    @property
    def rounds(self) -> int:
        """Recorded rounds."""
        return len(next(iter(self.series.values()), []))

    @property
    def stopped_by(self) -> str:
        """``"converged"``, ``"max_rounds"`` or ``"budget"``.

        Judged from the numbers every rank shares: the elapsed time is rank 0's alone, so a
        stop that is neither converged nor at ``max_rounds`` was the budget's.
        """
        if self.converged:
            return "converged"
        return "max_rounds" if self.rounds >= self.policy.max_rounds else "budget"

    @property
    def converged(self) -> bool:
        """Every figure reached the target half-width."""
        return self.max_half_width <= self.policy.target_half_width

    @property
    def max_half_width(self) -> float:
        """The widest figure's relative half-width (the widest median's when no figures)."""
        intervals = self.figures or self.medians
        return max((i.half_width for i in intervals.values()), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON form: the stopping outcome, the intervals and the raw per-round series."""
        return {
            "rounds": self.rounds,
            "warmup": self.policy.warmup,
            "converged": self.converged,
            "stopped_by": self.stopped_by,
            "target_half_width": self.policy.target_half_width,
            "max_half_width": self.max_half_width,
            "budget_s": self.policy.budget_s,
            "elapsed_s": self.elapsed_s,
            "confidence": CONFIDENCE,
            "medians": {k: v.to_dict() for k, v in self.medians.items()},
            "figures": {k: v.to_dict() for k, v in self.figures.items()},
            "series": self.series,
        }


def run_rounds(
    variants: Mapping[str, Variant],
    figures: Mapping[str, Figure],
    policy: RoundsPolicy,
    *,
    decide: Decide | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> RoundsResult:
    """Run ``variants`` in balanced rounds until ``policy`` says stop; see the module docstring.

    ``decide`` defaults to a local decision (one process). Collectives: the variants' own,
    plus whatever ``decide`` issues once per round from round ``min_rounds`` on.
    """
    if not variants:
        raise ValueError("run_rounds: no variants")
    names = list(variants)
    decide = decide or _decide_locally
    started = clock()
    for index in range(policy.warmup):
        for name in round_order(names, index):
            variants[name](index, warmup=True)
    series: dict[str, list[float]] = {}
    done, stop = 0, False
    while not stop:
        index = policy.warmup + done
        recorded: dict[str, float] = {}
        for name in round_order(names, index):
            recorded.update(_named(name, variants[name](index, warmup=False)))
        if done and recorded.keys() != series.keys():
            raise ValueError(
                f"run_rounds: round {index} measured {sorted(recorded)}, "
                f"earlier rounds {sorted(series)}"
            )
        for key, value in recorded.items():
            series.setdefault(key, []).append(value)
        done += 1
        if done >= policy.min_rounds:
            elapsed = clock() - started

            def propose(done: int = done, elapsed: float = elapsed) -> bool:
                if done >= policy.max_rounds or elapsed >= policy.budget_s:
                    return True
                if policy.project and elapsed * (1 + 1 / (done + policy.warmup)) > policy.budget_s:
                    return True
                widths = [i.half_width for i in _figure_intervals(series, figures, policy)]
                return max(widths, default=0.0) <= policy.target_half_width

            stop = decide(propose)
    return _result(series, figures, policy, clock() - started)


def rank0_decides(device: Any) -> Decide:
    """A ``decide`` for spawned worlds: global rank 0 proposes, one int64 broadcast over the
    world group (on ``device``) gives its answer to every rank; the other ranks compute nothing.
    """
    import torch
    import torch.distributed as dist

    def decide(propose: Callable[[], bool]) -> bool:
        flag = torch.zeros(1, dtype=torch.int64, device=device)
        if dist.get_rank() == 0:
            flag.fill_(int(propose()))
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    return decide


def _decide_locally(propose: Callable[[], bool]) -> bool:
    return propose()


def round_order(names: list[str], index: int) -> list[str]:
    """Round ``index``'s order of ``names``: row ``index`` of a Williams design.

    The base row is 0, 1, n-1, 2, n-2, ...; row r adds r (mod n) to every entry. For even n
    the n rows hold every ordered pair of neighbours exactly once; for odd n the next n rows
    are the first n reversed, and the 2n rows hold every ordered pair exactly twice.
    """
    n = len(names)
    base = [0]
    for j in range(1, n):
        base.append((j + 1) // 2 if j % 2 else n - j // 2)
    shift = index % n
    row = [names[(b + shift) % n] for b in base]
    if n % 2 and (index // n) % 2:
        row.reverse()
    return row


def _named(name: str, values: Values | None) -> dict[str, float]:
    if isinstance(values, Mapping):
        return {f"{name}.{key}": float(v) for key, v in values.items()}
    if values is None:
        raise ValueError(f"run_rounds: variant {name!r} returned no measurement")
    return {name: float(values)}


def _per_round(
    series: dict[str, list[float]], figures: Mapping[str, Figure]
) -> dict[str, list[float]]:
    rounds = len(next(iter(series.values()), []))
    rows = [{k: v[i] for k, v in series.items()} for i in range(rounds)]
    return {name: [float(figure(row)) for row in rows] for name, figure in figures.items()}


def _figure_intervals(
    series: dict[str, list[float]], figures: Mapping[str, Figure], policy: RoundsPolicy
) -> list[Interval]:
    per_round = _per_round(series, figures)
    if not figures:  # nothing to compare: converge on the medians themselves
        return [median_interval(v, seed=policy.seed) for v in series.values()]
    return [ratio_interval(v, seed=policy.seed) for v in per_round.values()]


def _result(
    series: dict[str, list[float]],
    figures: Mapping[str, Figure],
    policy: RoundsPolicy,
    elapsed: float,
) -> RoundsResult:
    per_round = _per_round(series, figures)
    return RoundsResult(
        policy=policy,
        series=series,
        medians={k: median_interval(v, seed=policy.seed) for k, v in series.items()},
        figures={k: ratio_interval(v, seed=policy.seed) for k, v in per_round.items()},
        figure_series=per_round,
        elapsed_s=elapsed,
    )
