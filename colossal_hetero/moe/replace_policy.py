"""The re-placement decision (pure: no torch.distributed), for :mod:`.replace`.

Each MoE layer is placed on its own (its all-to-all waits for its own slowest rank): from the
layer's measured expert loads and the ep ranks' speeds, :func:`.placement.place_experts`
gives the placement minimising the slowest rank's expected expert work. A layer moves only
when that lowers its slowest rank's work by more than ``min_gain`` (relative): a move costs
a transfer of weights and optimizer state, and equal-work reshuffles would churn.

With ``moe.packing`` on, :func:`decide_packing_placements` decides with the packing-aware
objective of :mod:`.packing` instead (compute of the slowest rank plus the packed a2a sends),
from the routing histogram and measured costs of moe/replace_packing.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from colossal_hetero.moe.packing import Routing, packing_objective, packing_search
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


def decide_packing_placements(
    routings: Sequence[Routing],
    speeds: Sequence[float],
    capacity: int,
    current: Sequence[Placement],
    costs: PackingCosts,
    min_gain: float = MIN_GAIN,
) -> tuple[list[Placement], dict[str, Any]]:
    """As :func:`decide_placements`, with the packing-aware objective (moe.packing on):

        max_d (sum_{e on d} load_e * seconds_per_token / speed_d) + seconds_per_send * packed

    ``routings[l]``: layer ``l``'s routing classes (top-k sets per source ep rank, summed over
    the world); ``costs``: the measured, agreed per-token and per-send seconds. A layer moves
    only when the objective drops by more than ``min_gain`` (relative). The record gives, per
    layer, the objective's parts and the predicted packed a2a rows and bytes before and after.
    """
    if len(routings) != len(current):
        raise ValueError(f"routing: {len(routings)} layers, {len(current)} placements")
    spt, sps = costs.seconds_per_token, costs.seconds_per_send
    chosen, layers = [], []
    for layer, (routing, old) in enumerate(zip(routings, current, strict=True)):
        choice = packing_search(speeds, capacity, routing, spt, sps)
        before = packing_objective(old, speeds, routing, spt, sps)
        after = packing_objective(choice.placement, speeds, routing, spt, sps)
        move = after < before * (1 - min_gain)
        new = choice.placement if move else old
        chosen.append(new)
        layers.append(
            {
                "layer": layer,
                "loads": [float(x) for x in routing.loads()],
                "search": choice.method,
                "moved": move,
                "placement": new.record()["devices"],
                "before": _parts(old, speeds, routing, costs),
                "after": _parts(new, speeds, routing, costs),
                "best_found": _parts(choice.placement, speeds, routing, costs),
            }
        )
    record = {
        "controller": "moe_placement",
        "objective": "packing",
        "speeds": list(speeds),
        "capacity": capacity,
        "min_gain": min_gain,
        "costs": asdict(costs),
        "layers": layers,
    }
    return chosen, record


def _parts(
    placement: Placement, speeds: Sequence[float], routing: Routing, costs: PackingCosts
) -> dict[str, float]:
    """The objective's parts for ``placement``, and its predicted packed and unpacked rows and
    packed bytes (forward and backward a2a's) over the measured interval."""
    sends = routing.sends(placement)
    compute = placement.max_work((routing.loads() * costs.seconds_per_token).tolist(), list(speeds))
    width = max(len(placement.experts_on(d)) for d in range(placement.num_devices))
    return {
        "compute_s": compute,
        "sends_s": costs.seconds_per_send * sends.packed,
        "objective_s": compute + costs.seconds_per_send * sends.packed,
        "packed_rows": sends.packed,
        "unpacked_rows": sends.unpacked,
        "packed_bytes": sends.packed * costs.row_bytes(width),
        "unpacked_bytes": sends.unpacked * 2 * costs.hidden * costs.itemsize,
    }


@dataclass(frozen=True, slots=True)
class PackingCosts:
    """Measured costs of the packing objective, agreed over the world (moe/replace_packing.py).

    ``seconds_per_token``: one (token, expert) row's expert compute, forward and backward, at
    speed 1; ``seconds_per_byte``: the a2a's per-byte time beyond its latency; ``hidden`` and
    ``itemsize``: the rows' hidden size and element size; ``ep``: ranks of the ep group;
    ``width``: weight and mark columns per packed row at the even placement.
    """

    seconds_per_token: float
    seconds_per_byte: float
    hidden: int
    itemsize: int
    ep: int
    width: int

    def row_bytes(self, width: int) -> int:
        """Bytes one packed send moves forward (dispatch row and combine row), as
        ``PackingStats`` counts them: ``(2 hidden + 2 width) * itemsize``."""
        return (2 * self.hidden + 2 * width) * self.itemsize

    @property
    def seconds_per_send(self) -> float:
        """One packed send's a2a seconds: its forward bytes twice (the backward a2a's mirror
        them) at the measured per-byte time, at the even width, over ``ep``: the a2a ends when
        every rank's rows are through, about the total rows over the ranks (the objective
        counts the rows of all ranks)."""
        return 2 * self.row_bytes(self.width) * self.seconds_per_byte / self.ep
