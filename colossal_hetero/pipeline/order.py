"""The kFkB order: which forward and backward passes one pipeline stage runs, in what order. Pure.

kFkB (Ada-Grouper, arXiv 2303.01675) is 1F1B played on *groups* of ``k`` micro-batches.
Micro-batch ``i`` belongs to group ``i // k``; there are ``G = ceil(m / k)`` groups and, when ``k``
does not divide ``m``, **the last group is the smaller one** (it holds ``m - (G - 1) * k``
micro-batches). Stage ``s`` of ``p`` runs:

1. warm-up: the forwards of the first ``W = min(p - s - 1, G)`` groups
   (that is ``min(k * (p - s - 1), m)`` forwards);
2. steady state: for ``j = 0 .. G - W - 1``, the forwards of group ``W + j``, then the backwards
   of group ``j``;
3. cool-down: the backwards of the last ``W`` groups.

Inside a group micro-batches run in increasing order. ``k = 1`` is exactly Colossal-AI's
``OneForwardOneBackwardSchedule`` (warm-up ``min(p - s - 1, m)``), and ``k = m`` is GPipe (all
forwards, then all backwards). Peak in-flight micro-batches (forwards done minus backwards done)
on stage ``s`` is ``min(k * (p - s), m)``; for ``k | m`` that is ``k * min(p - s, m / k)``.
"""

from __future__ import annotations

from typing import Literal

Op = Literal["F", "B"]
Step = tuple[Op, int]
"""One entry of a stage's order: ``("F", i)`` or ``("B", i)`` for micro-batch ``i``."""


def check_pipeline_args(num_stages: int, num_microbatches: int, k: int) -> None:
    """Raise ValueError (one line, naming the argument) unless ``1 <= k <= m`` and ``p, m >= 1``."""
    if num_stages < 1:
        raise ValueError(f"num_stages: must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches: must be >= 1, got {num_microbatches}")
    if not 1 <= k <= num_microbatches:
        raise ValueError(
            f"k: the kFkB group size must be in 1..num_microbatches ({num_microbatches}), got {k}"
        )


def group_bounds(num_microbatches: int, k: int) -> list[range]:
    """Micro-batches of each group in order: groups of ``k``, the last one possibly smaller."""
    return [range(g, min(g + k, num_microbatches)) for g in range(0, num_microbatches, k)]


def num_warmup_groups(num_stages: int, stage: int, num_microbatches: int, k: int) -> int:
    """Forward groups stage ``stage`` runs before its first backward: ``min(p - s - 1, G)``."""
    return min(num_stages - stage - 1, len(group_bounds(num_microbatches, k)))


def kfkb_order(num_stages: int, stage: int, num_microbatches: int, k: int) -> list[Step]:
    """The ordered forward/backward passes of stage ``stage`` under kFkB (rule in the module doc).

    Returns ``2 * num_microbatches`` steps. Raises ValueError for ``k`` outside ``1..m``, a stage
    outside ``0..p-1`` or non-positive counts.
    """
    check_pipeline_args(num_stages, num_microbatches, k)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage: must be in 0..{num_stages - 1}, got {stage}")
    groups = group_bounds(num_microbatches, k)
    warmup = num_warmup_groups(num_stages, stage, num_microbatches, k)
    order: list[Step] = []
    for g in range(warmup):
        order += [("F", i) for i in groups[g]]
    for j in range(len(groups) - warmup):
        order += [("F", i) for i in groups[warmup + j]]
        order += [("B", i) for i in groups[j]]
    for g in range(len(groups) - warmup, len(groups)):
        order += [("B", i) for i in groups[g]]
    return order


def peak_in_flight(order: list[Step]) -> int:
    """Most micro-batches whose forward is done and backward is not, over the order."""
    live = peak = 0
    for op, _ in order:
        live += 1 if op == "F" else -1
        peak = max(peak, live)
    return peak


def expected_peak_in_flight(num_stages: int, stage: int, num_microbatches: int, k: int) -> int:
    """Closed form of :func:`peak_in_flight` for :func:`kfkb_order`: ``min(k * (p - s), m)``."""
    return min(k * (num_stages - stage), num_microbatches)
