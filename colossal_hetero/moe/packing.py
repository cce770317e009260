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

At run time (moe/replace_packing.py) the routing comes as a :class:`Routing`: the distinct
top-k *sets* with how many tokens of each source device chose each (an exact histogram, so the
counts above are exact for any k; for k = 2 it is the co-selection matrix split by source).
For k > 2 the pair counts alone do not fix the packed count: a token whose three experts share
a device saves two sends, which three pair counts would count three times.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from colossal_hetero.moe.placement import (
    Placement,
    check_placement_inputs,
    exact_placement,
    place_experts,
)


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


@dataclass(frozen=True, slots=True)
class Routing:
    """Routing classes: ``weight[i]`` tokens, starting on device ``source[i]`` (-1: none, every
    send counts), chose the experts ``rows[i]`` (``[N, k]``, distinct per row)."""

    rows: np.ndarray
    weight: np.ndarray
    source: np.ndarray
    num_experts: int

    @classmethod
    def from_topk(
        cls,
        topk: np.ndarray | Sequence[Sequence[int]],
        num_experts: int,
        token_device: np.ndarray | Sequence[int] | None = None,
    ) -> Routing:
        arr = check_routing(topk, num_experts)
        src = np.full(arr.shape[0], -1, dtype=np.int64)
        if token_device is not None:
            src = np.asarray(token_device, dtype=np.int64)
            if src.shape != (arr.shape[0],):
                raise ValueError(f"token_device: need one device per token ({arr.shape[0]})")
        return cls(arr, np.ones(arr.shape[0], dtype=np.int64), src, num_experts)

    @classmethod
    def from_histogram(cls, counts: np.ndarray, num_experts: int, k: int) -> Routing:
        """From ``counts[d, i]``: tokens of source device ``d`` whose top-k set is the ``i``-th
        of :func:`subsets` ``(num_experts, k)``; empty classes are left out."""
        sets = subsets(num_experts, k)
        counts = np.asarray(counts, dtype=np.int64)
        if counts.ndim != 2 or counts.shape[1] != len(sets) or (counts < 0).any():
            raise ValueError(f"routing histogram: need [devices, {len(sets)}] counts >= 0")
        src, index = np.nonzero(counts)
        return cls(sets[index], counts[src, index], src.astype(np.int64), num_experts)

    def loads(self) -> np.ndarray:
        """Tokens per expert (float64)."""
        out = np.zeros(self.num_experts, dtype=np.float64)
        np.add.at(out, self.rows.reshape(-1), np.repeat(self.weight, self.rows.shape[1]))
        return out

    def sends(self, placement: Placement) -> SendCounts:
        """Remote dispatch sends without and with packing (a send to the source is local)."""
        dev = np.sort(np.asarray(placement.device_of, dtype=np.int64)[self.rows], axis=1)
        remote = dev != self.source[:, None]
        first = np.ones_like(dev, dtype=bool)
        first[:, 1:] = dev[:, 1:] != dev[:, :-1]
        w = self.weight[:, None]
        return SendCounts(int((remote * w).sum()), int(((first & remote) * w).sum()))


def subsets(num_experts: int, k: int) -> np.ndarray:
    """Every k-subset of the experts, ``[C(E, k), k]`` in lexicographic order, each sorted; its
    row is :func:`subset_index` of the set."""
    return np.array(list(itertools.combinations(range(num_experts), k)), dtype=np.int64).reshape(
        -1, k
    )


def subset_index(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """Row of each token's top-k set in :func:`subsets` (lexicographic rank), ``[T]``."""
    arr = np.sort(np.asarray(topk, dtype=np.int64), axis=1)
    tokens, k = arr.shape
    # rank = sum over positions j of the sets lexicographically before at position j:
    # sets that agree up to j-1 and have a smaller element at j.
    rank = np.zeros(tokens, dtype=np.int64)
    prev = np.full(tokens, -1, dtype=np.int64)
    table = np.array(
        [[math.comb(num_experts - 1 - v, k - 1 - j) for v in range(num_experts)] for j in range(k)],
        dtype=np.int64,
    )
    cumulative = np.concatenate([np.zeros((k, 1), dtype=np.int64), table.cumsum(axis=1)], axis=1)
    for j in range(k):
        # sets with element v at j, prev < v < arr[:, j]
        rank += cumulative[j, arr[:, j]] - cumulative[j, prev + 1]
        prev = arr[:, j]
    return rank


def _as_routing(topk: np.ndarray | Sequence[Sequence[int]] | Routing, num_experts: int) -> Routing:
    return topk if isinstance(topk, Routing) else Routing.from_topk(topk, num_experts)


def packing_objective(
    placement: Placement,
    speeds: Sequence[float],
    topk: np.ndarray | Sequence[Sequence[int]] | Routing,
    seconds_per_token: float,
    seconds_per_send: float,
) -> float:
    """Co-selection-aware cost of a placement, in seconds:

        max_d (sum_{e on d} load_e * seconds_per_token / speed_d) + seconds_per_send * packed

    Loads are read off the routing (the diagonal of :func:`coselection`). The first term is the
    compute objective of :mod:`.placement`; the second charges the packed dispatch sends (the
    combine a2a mirrors the dispatch, so fold a factor of 2 into ``seconds_per_send``).
    ``topk`` may be a :class:`Routing` (weighted classes; sends to the source are local).
    """
    if seconds_per_token < 0 or seconds_per_send < 0:
        raise ValueError("packing objective: per-token and per-send costs must be >= 0")
    routing = _as_routing(topk, placement.num_experts)
    compute = placement.max_work((routing.loads() * seconds_per_token).tolist(), speeds)
    return compute + seconds_per_send * routing.sends(placement).packed


PACKING_EXACT_MAX_EXPERTS = 8
"""Most experts per layer searched by branch and bound (E = 4..8 in our runs); beyond, local
search (:func:`local_search`) from the compute-optimal placement."""
MAX_NODES = 50_000
"""Search nodes before branch and bound stops with its incumbent (then improved by local
search); deterministic, so every rank stops at the same node."""


@dataclass(frozen=True, slots=True)
class PackingChoice:
    """A placement and how it was found: ``exact`` (branch and bound finished: optimal),
    ``node budget`` (stopped after :data:`MAX_NODES`, incumbent then local search) or
    ``local search`` (more than :data:`PACKING_EXACT_MAX_EXPERTS` experts)."""

    placement: Placement
    method: str


def packing_aware_placement(
    speeds: Sequence[float],
    capacity: int | Sequence[int],
    topk: np.ndarray | Sequence[Sequence[int]] | Routing,
    num_experts: int,
    seconds_per_token: float,
    seconds_per_send: float,
) -> Placement:
    """The placement minimising :func:`packing_objective` (see :func:`packing_search`)."""
    routing = _as_routing(topk, num_experts)
    return packing_search(speeds, capacity, routing, seconds_per_token, seconds_per_send).placement


def packing_search(
    speeds: Sequence[float],
    capacity: int | Sequence[int],
    routing: Routing,
    seconds_per_token: float,
    seconds_per_send: float,
    max_nodes: int = MAX_NODES,
) -> PackingChoice:
    """Branch and bound over the placements (up to :data:`PACKING_EXACT_MAX_EXPERTS` experts).

    Experts are visited in decreasing load; a partial placement's cost (its busiest device plus
    the sends of the experts placed so far: a token's distinct devices only grow) is a lower
    bound, so a node no cheaper than the incumbent (seeded with the compute-optimal placement)
    is pruned. Ties keep the first found, so the output is deterministic. More experts, or a
    search past ``max_nodes``: :func:`local_search` (documented in the choice's ``method``).
    """
    loads = routing.loads() * seconds_per_token
    costs = (seconds_per_token, seconds_per_send)
    if routing.num_experts > PACKING_EXACT_MAX_EXPERTS:
        seed = place_experts(loads.tolist(), speeds, capacity)
        return PackingChoice(local_search(seed, speeds, capacity, routing, *costs), "local search")
    seed = exact_placement(loads.tolist(), speeds, capacity)
    _, ss, caps = check_placement_inputs(loads.tolist(), speeds, capacity)
    best = [packing_objective(seed, ss, routing, *costs)]
    best_device_of = list(seed.device_of)
    found = _branch_and_bound(
        loads, ss, caps, routing, seconds_per_send, best, best_device_of, max_nodes
    )
    placement = Placement(tuple(best_device_of), len(ss))
    if found > max_nodes:
        placement = local_search(placement, ss, caps, routing, *costs)
        return PackingChoice(placement, "node budget")
    return PackingChoice(placement, "exact")


def _branch_and_bound(
    loads: np.ndarray,
    ss: tuple[float, ...],
    caps: tuple[int, ...],
    routing: Routing,
    seconds_per_send: float,
    best: list[float],
    best_device_of: list[int],
    max_nodes: int = MAX_NODES,
) -> int:
    """Depth-first search improving ``best`` / ``best_device_of`` in place; returns the nodes
    visited (more than ``max_nodes``: stopped early)."""
    num_experts = routing.num_experts
    tokens_of = [np.nonzero((routing.rows == e).any(axis=1))[0] for e in range(num_experts)]
    weight_of = [routing.weight[t] for t in tokens_of]
    source_of = [routing.source[t] for t in tokens_of]
    order = sorted(range(num_experts), key=lambda e: (-loads[e], e))
    masks = np.zeros(routing.rows.shape[0], dtype=np.int64)  # bit d: the class goes to d
    work, count, assign = [0.0] * len(ss), [0] * len(ss), [0] * num_experts
    nodes = [0]

    def dfs(i: int, compute: float, sends: int) -> None:
        if i == num_experts:
            best[0] = compute + seconds_per_send * sends
            best_device_of[:] = assign
            return
        e = order[i]
        for d in range(len(ss)):
            if count[d] >= caps[d] or nodes[0] > max_nodes:
                continue
            nodes[0] += 1
            hit = masks[tokens_of[e]]
            fresh = ((hit >> d) & 1 == 0) & (source_of[e] != d)
            new = int(weight_of[e][fresh].sum())
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
    return nodes[0]


def local_search(
    start: Placement,
    speeds: Sequence[float],
    capacity: int | Sequence[int],
    routing: Routing,
    seconds_per_token: float,
    seconds_per_send: float,
) -> Placement:
    """Best-improvement local search: each round tries every single move (an expert to another
    device with room) and every swap (two experts on different devices) and takes the one
    that lowers :func:`packing_objective` most (ties: the first in that order); stops when none
    does. Deterministic; never worse than ``start``; no optimality bound is claimed."""
    caps = capacity if not isinstance(capacity, int) else [capacity] * start.num_devices
    costs = (seconds_per_token, seconds_per_send)
    current = start
    value = packing_objective(current, speeds, routing, *costs)
    n = current.num_experts
    for _ in range(n * n):  # each round strictly improves: a bound for safety only
        device_of = list(current.device_of)
        candidates = []
        for e in range(n):
            for d in range(current.num_devices):
                if d != device_of[e] and len(current.experts_on(d)) < caps[d]:
                    candidates.append({e: d})
        for e, f in itertools.combinations(range(n), 2):
            if device_of[e] != device_of[f]:
                candidates.append({e: device_of[f], f: device_of[e]})
        best, best_value = None, value
        for change in candidates:
            moved = [change.get(e, d) for e, d in enumerate(device_of)]
            trial = Placement(tuple(moved), current.num_devices)
            trial_value = packing_objective(trial, speeds, routing, *costs)
            if trial_value < best_value:
                best, best_value = trial, trial_value
        if best is None:
            break
        current, value = best, best_value
    return current
