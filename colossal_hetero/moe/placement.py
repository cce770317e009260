"""Speed-aware expert placement (pure: no torch.distributed).

Problem. ``E`` experts with loads ``l_e`` (router token counts: the expert's compute is
proportional to the tokens it receives) go to ``D`` devices with speeds ``s_d`` (relative
throughput) and capacities ``c_d`` (the most experts device ``d`` may hold; faster devices may
hold more). Device ``d``'s expected expert work is ``W_d = sum_{e on d} l_e / s_d``; every
device waits for the slowest at the next all-to-all, so we minimise ``max_d W_d``. Every
expert is placed exactly once (no replicas here).

This is scheduling on uniform machines with cardinality limits (Q|card|Cmax), NP-hard in
general. Two solvers:

- :func:`exact_placement`: depth-first branch and bound over experts in decreasing load,
  seeded with the greedy value, pruning any partial placement whose busiest device is already
  no better than the best found, and skipping devices in the same state (equal speed,
  capacity, work and count) as an earlier one. Exact; fine for the 8-64 experts of one layer
  only when they are few (``auto`` uses it up to ``EXACT_MAX_EXPERTS``).
- :func:`greedy_placement`: LPT (longest processing time first), each expert on the device
  that would finish it earliest. Without capacity limits its makespan is at most
  ``2D / (D + 1)`` times the optimum (Gonzalez, Ibarra and Sahni, SIAM J. Comput. 1977,
  "Bounds for LPT schedules on uniform processors"); with limits no constant factor is
  claimed (a tight capacity can force a hot expert onto a slow device). O(E log E + E D).

Determinism: experts are visited in (decreasing load, index) order, devices in index order,
and a placement replaces the incumbent only when strictly better, so identical inputs give
identical placements on every rank with no broadcast needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

EXACT_MAX_EXPERTS = 12
Method = Literal["auto", "exact", "greedy"]


@dataclass(frozen=True, slots=True)
class Placement:
    """``device_of[e]``: the device that hosts expert ``e``; ``num_devices`` devices in all."""

    device_of: tuple[int, ...]
    num_devices: int

    def __post_init__(self) -> None:
        for e, d in enumerate(self.device_of):
            if not 0 <= d < self.num_devices:
                raise ValueError(
                    f"expert {e} is placed on device {d}, not in [0, {self.num_devices})"
                )

    @property
    def num_experts(self) -> int:
        return len(self.device_of)

    def experts_on(self, device: int) -> tuple[int, ...]:
        """Experts hosted by ``device``, in increasing index."""
        return tuple(e for e, d in enumerate(self.device_of) if d == device)

    def device_work(self, loads: Sequence[float], speeds: Sequence[float]) -> tuple[float, ...]:
        """``W_d = sum_{e on d} loads[e] / speeds[d]`` for every device."""
        totals = [0.0] * self.num_devices
        for e, d in enumerate(self.device_of):
            totals[d] += float(loads[e])
        return tuple(t / float(s) for t, s in zip(totals, speeds, strict=True))

    def max_work(self, loads: Sequence[float], speeds: Sequence[float]) -> float:
        """The objective: the slowest device's expected expert work."""
        return max(self.device_work(loads, speeds))

    def record(self) -> dict[str, Any]:
        """A JSON-ready decision record (device -> experts) for the controller log."""
        return {"devices": [list(self.experts_on(d)) for d in range(self.num_devices)]}


def placement_from_groups(groups: Sequence[Sequence[int]], num_experts: int) -> Placement:
    """A placement from ``groups[d]`` = the experts on device ``d``.

    ValueError, naming the expert, when one is on no device, on two devices (or twice on one),
    or out of range: a placement must hold every expert exactly once.
    """
    device_of: list[int | None] = [None] * num_experts
    for d, experts in enumerate(groups):
        for e in experts:
            if not 0 <= int(e) < num_experts:
                raise ValueError(
                    f"placement: expert {e} on device {d} is not in [0, {num_experts})"
                )
            seen = device_of[int(e)]
            if seen is not None:
                raise ValueError(f"placement: expert {e} is placed twice (devices {seen} and {d})")
            device_of[int(e)] = d
    lost = [e for e, d in enumerate(device_of) if d is None]
    if lost:
        raise ValueError(f"placement: expert {lost[0]} is placed on no device (lost: {lost})")
    return Placement(tuple(d for d in device_of if d is not None), len(groups))


def even_placement(num_experts: int, num_devices: int) -> Placement:
    """Colossal-AI's layout: contiguous blocks of ``num_experts / num_devices`` experts."""
    check_ep(num_experts, num_devices, num_devices)
    per = num_experts // num_devices
    return Placement(tuple(e // per for e in range(num_experts)), num_devices)


def check_ep(num_experts: int, ep: int, world_size: int) -> None:
    """ValueError (naming ``parallel.ep``) unless ep >= 1 divides both the experts and the world."""
    if ep < 1:
        raise ValueError(f"parallel.ep must be >= 1, got {ep}")
    if num_experts % ep:
        raise ValueError(f"parallel.ep={ep} does not divide the number of experts ({num_experts})")
    if world_size % ep:
        raise ValueError(f"parallel.ep={ep} does not divide the world size ({world_size})")


def check_placement_inputs(
    loads: Sequence[float], speeds: Sequence[float], capacity: int | Sequence[int]
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[int, ...]]:
    """Loads, speeds and per-device capacities as tuples; ValueError on bad or infeasible input."""
    ls = tuple(float(x) for x in loads)
    ss = tuple(float(x) for x in speeds)
    if not ls:
        raise ValueError("expert loads: need at least one expert")
    if not ss:
        raise ValueError("device speeds: need at least one device")
    for e, x in enumerate(ls):
        if not (math.isfinite(x) and x >= 0):
            raise ValueError(f"expert loads: load of expert {e} must be finite and >= 0, got {x}")
    for d, x in enumerate(ss):
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"device speeds: speed of device {d} must be finite and > 0, got {x}")
    caps = (capacity,) * len(ss) if isinstance(capacity, int) else tuple(int(c) for c in capacity)
    if len(caps) != len(ss) or any(c < 0 for c in caps):
        raise ValueError(f"expert capacity: need one value >= 0 per device, got {list(caps)}")
    if sum(caps) < len(ls):
        raise ValueError(f"expert capacity: devices hold {sum(caps)} experts, fewer than {len(ls)}")
    return ls, ss, caps


def _order(loads: Sequence[float]) -> list[int]:
    """Experts by decreasing load, ties by index: the deterministic visiting order."""
    return sorted(range(len(loads)), key=lambda e: (-loads[e], e))


def greedy_placement(
    loads: Sequence[float], speeds: Sequence[float], capacity: int | Sequence[int]
) -> Placement:
    """LPT: hottest expert first, each onto the free device that finishes it earliest.

    Ties go to the lower device index. Bound (no capacity limits): ``2D/(D+1)`` x optimal.
    """
    ls, ss, caps = check_placement_inputs(loads, speeds, capacity)
    work = [0.0] * len(ss)
    count = [0] * len(ss)
    device_of = [0] * len(ls)
    for e in _order(ls):
        free = (d for d in range(len(ss)) if count[d] < caps[d])
        best = min(free, key=lambda d: ((work[d] + ls[e]) / ss[d], d))
        device_of[e] = best
        work[best] += ls[e]
        count[best] += 1
    return Placement(tuple(device_of), len(ss))


def exact_placement(
    loads: Sequence[float], speeds: Sequence[float], capacity: int | Sequence[int]
) -> Placement:
    """The placement with minimal ``max_d W_d``, by branch and bound (exponential worst case)."""
    ls, ss, caps = check_placement_inputs(loads, speeds, capacity)
    seed = greedy_placement(ls, ss, caps)
    order = _order(ls)
    n_dev = len(ss)
    best_value = [seed.max_work(ls, ss)]  # one-element list: the incumbent, set from dfs
    best_device_of = list(seed.device_of)
    work = [0.0] * n_dev
    count = [0] * n_dev
    assign = [0] * len(ls)

    def dfs(i: int, current: float) -> None:
        if i == len(order):
            # Every leaf reached beats the incumbent strictly (pruned otherwise).
            best_value[0] = current
            best_device_of[:] = assign
            return
        e = order[i]
        tried: set[tuple[float, float, int, int]] = set()
        for d in range(n_dev):
            state = (ss[d], work[d], count[d], caps[d])
            if count[d] >= caps[d] or state in tried:
                continue  # full, or interchangeable with a device already tried
            tried.add(state)
            value = max(current, (work[d] + ls[e]) / ss[d])
            if value >= best_value[0]:
                continue  # cannot beat the incumbent: work only grows below this node
            before = work[d]
            work[d] = before + ls[e]
            count[d] += 1
            assign[e] = d
            dfs(i + 1, value)
            work[d] = before  # restored exactly (subtracting could leave a rounding residue)
            count[d] -= 1

    dfs(0, 0.0)
    return Placement(tuple(best_device_of), n_dev)


def place_experts(
    loads: Sequence[float],
    speeds: Sequence[float],
    capacity: int | Sequence[int],
    method: Method = "auto",
) -> Placement:
    """Speed-aware placement: ``auto`` is exact up to ``EXACT_MAX_EXPERTS`` experts, else LPT."""
    if method not in ("auto", "exact", "greedy"):
        raise ValueError(f"placement method must be auto, exact or greedy, got {method!r}")
    if method == "exact" or (method == "auto" and len(loads) <= EXACT_MAX_EXPERTS):
        return exact_placement(loads, speeds, capacity)
    return greedy_placement(loads, speeds, capacity)
