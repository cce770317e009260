"""Measured alpha-beta profile of the gradient all-reduce, agreed over the world.

The chunked reducers (moe/scheduler.py) need, identically on every rank, the cost
``T(S) = alpha + S / beta`` of one all-reduce of ``S`` bytes on their group: to size chunks
(:func:`.chunks.chunk_bytes_for`) and to predict whether a chunk fits before the next a2a.
Each rank times all-reduces of two sizes on each of its groups (median of 7 repeats: with 3,
on a loaded host, a 4 KiB all-reduce's median once came out at 353 ms against about 7 ms); the
world takes the elementwise maximum (the slowest group of each kind sets the pace), and
every rank fits the same two-point line from the same numbers.

Collective: call on every rank, in the same order, with one group per kind (the rank's own
group of that kind).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

SIZES = (4096, 262144)
"""The two message sizes (bytes) of the fit: latency-dominated and bandwidth-dominated."""


def _time_all_reduce(group: ProcessGroup, nbytes: int, repeats: int) -> float:
    buf = torch.zeros(nbytes // 4, dtype=torch.float32)
    dist.all_reduce(buf, group=group)  # warm the connections
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(buf, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fit_alpha_beta(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) of the line through two (size, time) points (pure).

    Timing noise can make the larger message no slower: then alpha is the small message's
    time (latency-bound) and beta the large message's mean rate, never a negative or infinite
    value.
    """
    (s1, s2), (t1, t2) = sizes, times
    if s2 <= s1:
        raise ValueError("fit_alpha_beta: need two increasing sizes")
    if t2 <= t1 or t1 <= 0:
        return max(t1, 0.0), s2 / max(t2, 1e-9)
    beta = (s2 - s1) / (t2 - t1)
    return max(0.0, t1 - s1 / beta), beta


def profile_groups(groups: Sequence[ProcessGroup], repeats: int = 7) -> list[tuple[float, float]]:
    """(alpha, beta) per group kind, identical on every rank (see the module)."""
    measured = [_time_all_reduce(g, n, repeats) for g in groups for n in SIZES]
    agreed = torch.tensor(measured, dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    values = agreed.tolist()
    return [fit_alpha_beta(SIZES, values[2 * i : 2 * i + 2]) for i in range(len(groups))]
