"""A short timed trial of candidate stage splits, from a plain Booster training loop.

Measured stage times (``plan.stage_times``) cannot tell splits apart that they predict within a
few percent of each other: a block's time moves by ~10% with the machine's load and with what
the neighbouring stage runs beside it. The way out is to run each near-best split for a few
steps and keep the fastest. :func:`pick_split` is that trial:

- the caller builds one runner per candidate (a plugin with ``parallel.num_layers_per_stage``
  set to it) and passes ``step_seconds(candidate, i)``, which runs step ``i`` of that candidate
  and returns this rank's seconds;
- step ``i`` runs the candidates in an order rotated by ``i`` (no candidate always first after
  another's warm caches or a draining link);
- each step's seconds are the slowest rank's (one ``all_reduce`` MAX on ``group``): a
  pipeline step lasts as long as its slowest stage;
- each candidate's score is the median of its steps; the least median wins, ties to the
  earlier candidate (list the plugin's own split first); with ``margin`` the first candidate's
  score counts ``1 - margin`` of its median, so another split displaces the planned one only
  when its steps ran more than that fraction faster (a few steps of near ties differ by less
  than their noise, and the planned split is the stage times' best);
- the trial stops early, after a whole step of every candidate, once the remaining steps cannot
  change the pick (:func:`decided`: the leader's median with every remaining step infinitely
  slow still beats every other's with its remaining steps free). The pick is then the one the
  full trial would make.

Contract: every rank of ``group`` calls with the same candidates in the same order and the same
``steps`` (``step_seconds`` may run collectives: every rank runs the same steps in the same
order). Every rank then gets the same pick, as all of them see the same reduced seconds.
Candidates come from ``planner.stages.split_candidates`` (the plugin's split, then the
near-best ones its stage times predict).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class SplitTrial:
    """The candidates, each one's per-step seconds (slowest rank's), and the pick."""

    candidates: tuple[tuple[int, ...], ...]
    steps_s: tuple[tuple[float, ...], ...]
    best: int
    """Index of the picked candidate."""

    @property
    def split(self) -> list[int]:
        return list(self.candidates[self.best])

    @property
    def medians_s(self) -> list[float]:
        return [statistics.median(s) if s else float("inf") for s in self.steps_s]


def rotated(count: int, step: int) -> list[int]:
    """The candidates' order in step ``step``: ``0..count-1`` rotated left by ``step``."""
    shift = step % count
    return [*range(shift, count), *range(shift)]


def score_weight(index: int, margin: float) -> float:
    """What a candidate's median counts for: ``1 - margin`` for the first (the plugin's
    split), 1 for the others."""
    return 1.0 - margin if index == 0 else 1.0


def decided(seen: Sequence[Sequence[float]], steps: int, margin: float = 0.0) -> int | None:
    """The candidate that wins whatever the remaining steps bring, or None.

    ``seen[i]``: candidate ``i``'s step seconds so far (every one the same count), out of
    ``steps``. Candidate ``c`` is decided when its score with every missing step at +inf is
    below every other candidate's score with its missing steps at 0 s (step times are >= 0),
    or equal to it for a later candidate (ties go to the earlier one). A score is the median,
    the first candidate's times ``1 - margin`` (:func:`pick_split`)."""
    missing = [steps - len(s) for s in seen]
    scale = [score_weight(i, margin) for i in range(len(seen))]
    worst = [
        k * statistics.median([*s, *[math.inf] * n])
        for s, n, k in zip(seen, missing, scale, strict=True)
    ]
    best = [
        k * statistics.median([*s, *[0.0] * n])
        for s, n, k in zip(seen, missing, scale, strict=True)
    ]
    for c in range(len(seen)):
        if all(
            worst[c] < best[o] or (worst[c] == best[o] and c < o)
            for o in range(len(seen))
            if o != c
        ):
            return c
    return None


def pick_split(
    candidates: Sequence[Sequence[int]],
    step_seconds: Callable[[int, int], float],
    steps: int,
    group: Any = None,
    *,
    device: torch.device,
    margin: float = 0.0,
) -> SplitTrial:
    """Run up to ``steps`` steps of every candidate (``step_seconds(index, step)``: this rank's
    seconds for step ``step`` of ``candidates[index]``) and pick the one whose median slowest-
    rank step is least; see the module docstring for the contract. One candidate: no steps run.
    ``group``: the process group the ranks agree over (None: the world); ``device``: where its
    backend reduces (the ranks' accelerator under NCCL). ``margin`` in [0, 1): how much faster
    (a fraction of its median) another candidate must run to displace the first. Collective."""
    if not candidates:
        raise ValueError("pick_split: no candidate splits")
    if steps < 1:
        raise ValueError(f"pick_split: steps must be >= 1, got {steps}")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"pick_split: margin must be in [0, 1), got {margin}")
    layers = {sum(c) for c in candidates}
    sizes = {len(c) for c in candidates}
    if len(layers) != 1 or len(sizes) != 1 or any(n < 1 for c in candidates for n in c):
        raise ValueError(
            "pick_split: candidates must split the same layers over the same stages, "
            f"each stage >= 1, got {[list(c) for c in candidates]}"
        )
    frozen = tuple(tuple(c) for c in candidates)
    if len(frozen) == 1:
        return SplitTrial(frozen, ((),), 0)
    seen: list[list[float]] = [[] for _ in frozen]
    for step in range(steps):
        for index in rotated(len(frozen), step):
            seconds = float(step_seconds(index, step))
            mine = torch.tensor([seconds], dtype=torch.float64, device=device)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
            seen[index].append(float(mine.item()))
        if step + 1 < steps and decided(seen, steps, margin) is not None:
            break  # the remaining steps cannot change the pick
    scores = [statistics.median(s) * score_weight(i, margin) for i, s in enumerate(seen)]
    best = min(range(len(frozen)), key=lambda i: (scores[i], i))
    return SplitTrial(frozen, tuple(tuple(s) for s in seen), best)
