"""Expert packing planner (pure: no torch.distributed).

Routing is top-k: token ``t`` selects experts ``topk[t, 0..k-1]`` (distinct). Without packing
the dispatch all-to-all sends one copy of the token per selected expert (``k`` sends). With
packing, a token is sent once per *device* hosting at least one of its experts, and the
partial expert outputs are combined on that device before the combine all-to-all sends one
result back, so both all-to-alls shrink by the same factor.

Counts (``P`` a :class:`~.placement.Placement`):

    unpacked = sum_t k                          (sends of the dispatch a2a)
    packed   = sum_t |{ P(e) : e in topk[t] }|

With ``token_device`` (the device each token starts on) a send to the token's own device is
local, not network traffic, and is left out of both counts.

Co-selection: ``C[e, f]`` = tokens that select both ``e`` and ``f`` (``C[e, e]`` = the load of
``e``). For k = 2, ``packed = T*2 - sum_{e<f, P(e)=P(f)} C[e, f]``: a placement that puts
frequently co-selected experts together saves sends. :func:`packing_objective` joins that to
the compute objective of :mod:`.placement`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from colossal_hetero.moe.placement import Placement, check_placement_inputs, exact_placement


@dataclass(frozen=True, slots=True)
class SendCounts:
    """Dispatch a2a sends (token copies) without and with packing."""

    unpacked: int
    packed: int

    @property
    def saved(self) -> int:
        return self.unpacked - self.packed


def check_routing(topk: np.ndarray | Sequence[Sequence[int]], num_experts: int) -> np.ndarray:
    """``topk`` as an int64 array [T, k]; ValueError on k > experts, out-of-range or repeats."""
    arr = np.asarray(topk, dtype=np.int64)
    if arr.ndim != 2:
        raise ValueError(f"routing: topk must be [tokens, k], got shape {arr.shape}")
    k = arr.shape[1]
    if k < 1 or k > num_experts:
        raise ValueError(f"top_k={k} must be in [1, num_experts={num_experts}]")
    if arr.size and (arr.min() < 0 or arr.max() >= num_experts):
        raise ValueError(f"routing: expert ids must be in [0, {num_experts})")
    if arr.size and np.any(np.diff(np.sort(arr, axis=1), axis=1) == 0):
        raise ValueError("routing: a token selects the same expert twice")
    return arr


def a2a_sends(
    topk: np.ndarray | Sequence[Sequence[int]],
    placement: Placement,
    token_device: np.ndarray | Sequence[int] | None = None,
) -> SendCounts:
    """Dispatch sends without and with packing (see the module docstring for the counts)."""
    arr = check_routing(topk, placement.num_experts)
    # Each token's devices, sorted so that a token's distinct devices are the row's changes.
    dev = np.sort(np.asarray(placement.device_of, dtype=np.int64)[arr], axis=1)  # [T, k]
    if token_device is None:
        remote = np.ones_like(dev, dtype=bool)
    else:
        src = np.asarray(token_device, dtype=np.int64)
        if src.shape != (arr.shape[0],):
            raise ValueError(f"token_device: need one device per token ({arr.shape[0]})")
        remote = dev != src[:, None]
    first = np.ones_like(dev, dtype=bool)
    first[:, 1:] = dev[:, 1:] != dev[:, :-1]
    unpacked = int(remote.sum())
    packed = int((first & remote).sum())
    return SendCounts(unpacked, packed)


def coselection(topk: np.ndarray | Sequence[Sequence[int]], num_experts: int) -> np.ndarray:
    """``C[e, f]``: tokens selecting both ``e`` and ``f``; the diagonal is each expert's load."""
    arr = check_routing(topk, num_experts)
    onehot = np.zeros((arr.shape[0], num_experts), dtype=np.int64)
    np.put_along_axis(onehot, arr, 1, axis=1)
    return onehot.T @ onehot


def packing_objective(
    placement: Placement,
    speeds: Sequence[float],
    topk: np.ndarray | Sequence[Sequence[int]],
    seconds_per_token: float,
    seconds_per_send: float,
) -> float:
    """Co-selection-aware cost of a placement, in seconds:

        max_d (sum_{e on d} load_e * seconds_per_token / speed_d) + seconds_per_send * packed

    Loads are read off the routing (the diagonal of :func:`coselection`). The first term is the
    compute objective of :mod:`.placement`; the second charges the packed dispatch sends (the
    combine a2a mirrors the dispatch, so fold a factor of 2 into ``seconds_per_send``).
    """
    if seconds_per_token < 0 or seconds_per_send < 0:
        raise ValueError("packing objective: per-token and per-send costs must be >= 0")
    loads = np.diag(coselection(topk, placement.num_experts)).astype(float) * seconds_per_token
    compute = placement.max_work(loads.tolist(), speeds)
    return compute + seconds_per_send * a2a_sends(topk, placement).packed


def packing_aware_placement(
    speeds: Sequence[float],
    capacity: int | Sequence[int],
    topk: np.ndarray | Sequence[Sequence[int]],
    num_experts: int,
    seconds_per_token: float,
    seconds_per_send: float,
) -> Placement:
    """The placement minimising :func:`packing_objective`, by branch and bound (small E only).

    Experts are visited in decreasing load; a partial placement's cost (its busiest device plus
    the sends of the experts placed so far: a token's distinct devices only grow) is a lower
    bound, so a node no cheaper than the incumbent (seeded with the compute-optimal placement)
    is pruned. Ties keep the first found, so the output is deterministic.
    """
    arr = check_routing(topk, num_experts)
    loads = np.diag(coselection(arr, num_experts)).astype(float) * seconds_per_token
    seed = exact_placement(loads.tolist(), speeds, capacity)
    _, ss, caps = check_placement_inputs(loads.tolist(), speeds, capacity)
    tokens_of = [np.nonzero((arr == e).any(axis=1))[0] for e in range(num_experts)]
    order = sorted(range(num_experts), key=lambda e: (-loads[e], e))
    best = [packing_objective(seed, ss, arr, seconds_per_token, seconds_per_send)]
    best_device_of = list(seed.device_of)
    masks = np.zeros(arr.shape[0], dtype=np.int64)  # bit d set: the token already goes to d
    work, count, assign = [0.0] * len(ss), [0] * len(ss), [0] * num_experts

    def dfs(i: int, compute: float, sends: int) -> None:
        if i == num_experts:
            best[0] = compute + seconds_per_send * sends
            best_device_of[:] = assign
            return
        e = order[i]
        for d in range(len(ss)):
            if count[d] >= caps[d]:
                continue
            hit = masks[tokens_of[e]]
            new = int(((hit >> d) & 1 == 0).sum())
            value = max(compute, (work[d] + loads[e]) / ss[d])
            if value + seconds_per_send * (sends + new) >= best[0]:
                continue  # a lower bound of every completion below this node
            before = work[d]
            work[d], assign[e] = before + loads[e], d
            count[d] += 1
            masks[tokens_of[e]] = hit | (1 << d)
            dfs(i + 1, value, sends + new)
            masks[tokens_of[e]] = hit
            work[d] = before
            count[d] -= 1

    dfs(0, 0.0, 0)
    return Placement(tuple(best_device_of), len(ss))
