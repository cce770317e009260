"""The re-placement decision (pure: no torch.distributed), for :mod:`.replace`.

Each MoE layer is placed on its own (its all-to-all waits for its own slowest rank): from the
layer's measured expert loads and the ep ranks' speeds, :func:`.placement.place_experts`
gives the placement minimising the slowest rank's expected expert work. A layer moves only
when that lowers its slowest rank's work by more than ``min_gain`` (relative): a move costs
a transfer of weights and optimizer state, and equal-work reshuffles would churn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from colossal_hetero.moe.placement import Placement, place_experts

MIN_GAIN = 0.10


def ep_speeds(speeds: Sequence[float], ep: int) -> list[float]:
    """Speed of each ep rank from the world's per-rank speeds: rank ``i * ep + d`` is replica
    ``i`` of ep rank ``d`` (Colossal-AI's mesh), and the slowest replica sets the pace."""
    if len(speeds) % ep:
        raise ValueError(f"device speeds: {len(speeds)} ranks is not a multiple of ep={ep}")
    return [min(speeds[d::ep]) for d in range(ep)]


def ep_capacity(limit: int, num_experts: int, ep: int) -> int:
    """Most experts per ep rank: ``moe.max_experts_per_rank`` or, for 0, twice the even share,
    never more than all the experts; ValueError when the ranks could not hold them all."""
    capacity = min(limit or 2 * (num_experts // ep), num_experts)
    if capacity * ep < num_experts:
        raise ValueError(
            f"moe.max_experts_per_rank: {ep} ranks of {capacity} cannot hold {num_experts} experts"
        )
    return capacity


def decide_placements(
    loads: Sequence[Sequence[float]],
    speeds: Sequence[float],
    capacity: int,
    current: Sequence[Placement],
    min_gain: float = MIN_GAIN,
) -> tuple[list[Placement], dict[str, Any]]:
    """New placement per layer and the decision record (JSON-ready).

    ``loads[l][e]``: tokens routed to expert ``e`` of layer ``l`` (summed over the world);
    ``speeds[d]``: ep rank ``d``'s relative speed. Deterministic: identical inputs give
    identical placements on every rank.
    """
    if len(loads) != len(current):
        raise ValueError(f"expert loads: {len(loads)} layers, {len(current)} placements")
    chosen, layers = [], []
    for layer, (row, old) in enumerate(zip(loads, current, strict=True)):
        before = old.max_work(row, speeds)
        best = place_experts(row, speeds, capacity)
        after = best.max_work(row, speeds)
        move = after < before * (1 - min_gain)
        chosen.append(best if move else old)
        layers.append(
            {
                "layer": layer,
                "loads": [float(x) for x in row],
                "max_work_before": before,
                "max_work_after": after if move else before,
                "moved": move,
                "placement": (best if move else old).record()["devices"],
            }
        )
    record = {
        "controller": "moe_placement",
        "speeds": list(speeds),
        "capacity": capacity,
        "layers": layers,
    }
    return chosen, record
