"""Measured alpha-beta profile of the gradient all-reduce, agreed over the world.

The chunked reducers (moe/scheduler.py) need, identically on every rank, the cost
``T(S) = alpha + S / beta`` of one all-reduce of ``S`` bytes on their group: to size chunks
(:func:`.chunks.choose_chunk_bytes`) and to predict whether a chunk fits before the next a2a.

How, so that the result does not swing with the host's load (session 10: two probes of 4 KiB
and 256 KiB, median of 7 each, gave chunk sizes of 42-382 KiB between runs of one link):

- *Probes sized for the link* (:data:`SIZES`): 16 KiB, the smallest chunk the wiring sends, for
  the fixed cost; 256 KiB and 1 MiB, both bandwidth-bound at the benchmark's rates (on the
  300 Mbit/s shaped link about 12 and 46 ms, against 3 ms for 16 KiB), for the slope. With
  4 KiB and 256 KiB, the slope came from a 4-8 ms difference between two noisy times, and the
  fit's ``alpha * beta`` followed every burst of load.
- *Interleaved repeats*: each repeat times every size once, so a burst of load falls on all
  sizes alike instead of on one size's block of repeats.
- *Robust per size*: the lower quartile of the repeats (load only ever adds time; the median
  of 7 still took one burst); the smallest probe, whose fixed cost is the noisiest figure,
  is timed :data:`SMALL_REPEATS` times per repeat.
- *Agreed once*: one ``all_gather`` over the world of every rank's per-size times, and the
  median over ranks (:func:`agree_times`; the maximum, used before, took whichever rank a
  burst had just held up); every rank fits the same line from the same numbers
  (:func:`fit_alpha_beta`): ``beta`` from the two largest probes, ``alpha`` the smallest
  probe's time less its bytes at that rate.

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

from colossal_hetero.utils.collectives import all_gather_anywhere
from colossal_hetero.utils.device import collective_device, synchronize

SIZES = (16384, 262144, 1048576)
"""Probe sizes (bytes): the smallest chunk (fixed cost), two bandwidth-bound ones (slope)."""
SMALL_REPEATS = 3
"""Timings of the smallest probe per repeat: its fixed cost is the noisiest figure (a few ms
that load can double), and it costs little."""


def lower_quartile(samples: Sequence[float]) -> float:
    """The lower quartile of ``samples`` (the order statistic at index ``(n - 1) // 4``; pure):
    robust to the long upper tail that host load adds to a timing."""
    if not samples:
        raise ValueError("lower_quartile: no samples")
    return sorted(samples)[(len(samples) - 1) // 4]


def _sample_all_reduce(
    group: ProcessGroup, sizes: Sequence[int], repeats: int
) -> list[list[float]]:
    """Per size, timings (s) of one all-reduce on ``group``, interleaved: ``repeats`` rounds,
    each timing the smallest size :data:`SMALL_REPEATS` times and every other size once."""
    device = collective_device(group)
    bufs = [torch.zeros(max(1, n // 4), dtype=torch.float32, device=device) for n in sizes]
    for buf in bufs:
        dist.all_reduce(buf, group=group)  # warm the connections
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(repeats):
        for index, (buf, row) in enumerate(zip(bufs, times, strict=True)):
            for _ in range(SMALL_REPEATS if index == 0 else 1):
                dist.barrier(group=group)
                start = time.perf_counter()
                dist.all_reduce(buf, group=group)
                synchronize(device)  # an accelerator's collective ends after its launch
                row.append(time.perf_counter() - start)
    return times


def fit_alpha_beta(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) from (size, time) points, sizes increasing (pure).

    ``beta`` is the slope of the two largest sizes, ``alpha`` the smallest size's time less its
    bytes at ``beta`` (with two sizes: the line through both). Timing noise can make the larger
    message no slower: then alpha is the smallest message's time and beta the largest
    message's mean rate, never a negative or infinite value.
    """
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError("fit_alpha_beta: need two or more (size, time) points")
    if any(sizes[i + 1] <= sizes[i] for i in range(len(sizes) - 1)):
        raise ValueError("fit_alpha_beta: need increasing sizes")
    s1, s2, s3 = sizes[0], sizes[-2], sizes[-1]
    t1, t2, t3 = times[0], times[-2], times[-1]
    if t3 <= t2 or t1 <= 0:
        return max(t1, 0.0), s3 / max(t3, 1e-9)
    beta = (s3 - s2) / (t3 - t2)
    return max(0.0, t1 - s1 / beta), beta


def agree_times(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Elementwise median over ranks of each rank's per-size times (pure): the time of one
    collective differs between its members only by when each left the barrier, and a
    median, unlike a maximum, ignores the one rank a burst of load held up."""
    if not per_rank or len({len(row) for row in per_rank}) != 1:
        raise ValueError("agree_times: need the same number of times from every rank")
    return [statistics.median(column) for column in zip(*per_rank, strict=True)]


def profile_groups(groups: Sequence[ProcessGroup], repeats: int = 7) -> list[tuple[float, float]]:
    """(alpha, beta) per group kind, identical on every rank (see the module)."""
    measured = [
        lower_quartile(row) for g in groups for row in _sample_all_reduce(g, SIZES, repeats)
    ]
    gathered = all_gather_anywhere(torch.tensor(measured, dtype=torch.float64))
    values = agree_times([t.tolist() for t in gathered])
    n = len(SIZES)
    return [fit_alpha_beta(SIZES, values[n * i : n * i + n]) for i in range(len(groups))]
