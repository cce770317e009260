"""Fixed gradient chunks and the chunk size (pure: no torch.distributed).

The gradient all-reduce is cut into chunks whose boundaries depend only on the parameters'
sizes and dtypes and a chunk size in bytes, never on routing or timing, so every rank builds
the same chunks in the same order. Parameters are walked in a given order (the order backward
produced their gradients, agreed once: moe/scheduler.py's ``learn_order``), by default in
*reverse* registration order; a chunk packs consecutive parameters, or slices of one, up to
``chunk_bytes``, and never mixes dtypes (it is one flat buffer).

Chunk size (Lina's tensor partitioning, digest section 3.3): with an all-reduce of ``S`` bytes
costing ``T(S) = alpha + S / beta``, an a2a that becomes ready waits for at most the
``max_inflight`` chunks already on the wire, ``max_inflight * T(S)``, while the efficiency of
the chunked all-reduce is ``(S / beta) / T(S)``. Session 10 took the smallest ``S`` of a given
efficiency, ``S >= e / (1 - e) * alpha * beta``; that depends on ``alpha * beta``, whose noise
under load (42-382 KiB between runs of one link) the step time followed.

A stable choice (:func:`choose_chunk_bytes`) instead compares chunk counts ``k`` of the
gradient's ``N`` bytes by a predicted cost, :func:`chunking_cost`: ``k * alpha + N / beta``
for the chunks themselves plus what the efficiency rule misses, the a2a wait bound (with
priority a ready a2a waits for at most one chunk on the wire, ``alpha + N / (k * beta)``, for
each of ``waits`` a2a's per step).
The cost is flat near its least, so it takes the *fewest* chunks (the largest) whose cost is
within ``slack`` of the least: noise in ``alpha`` moves the least count, rarely that one.

Even chunks: cutting ``N`` bytes into pieces of at most ``S`` leaves a tail chunk of
``N mod S`` bytes, which pays a whole ``alpha`` for a few bytes (measured: an 8 KiB tail of
the dense gradient ended 4 ms after the 379 KiB chunk before it). :func:`even_chunk_bytes`
instead cuts ``N`` into ``max(1, N // S)`` nearly equal chunks, each at least ``S`` (so at
least as efficient) and below ``2 S``; with ``min_count``, into at least that many (a small
gradient cut finer, so its first chunks can go before the end of backward).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements ``[start, stop)`` of the flattened parameter ``param`` (its registration index)."""

    param: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """One all-reduce: its segments, concatenated in order into a flat buffer of ``numel``."""

    index: int
    segments: tuple[Segment, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(s.stop - s.start for s in self.segments)

    @property
    def params(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(s.param for s in self.segments))


def plan_chunks(
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    chunk_bytes: int,
    order: Sequence[int] | None = None,
    phases: Sequence[int] | None = None,
) -> tuple[Chunk, ...]:
    """Chunks over parameters ``numels[i]`` of ``dtypes[i]``, walked in ``order`` (parameter
    indices, a permutation; default: last parameter first).

    Every element of every parameter is in exactly one chunk; a chunk holds at most
    ``chunk_bytes // itemsize`` elements. Without ``phases`` chunks are filled to that size in
    turn. With ``phases`` (one label per parameter: when backward makes its gradient ready,
    e.g. between which two a2a's) see :func:`phase_runs`: no chunk spans a phase change but
    for a small phase merged into the next, and each run is cut into the fewest even chunks.
    ValueError (naming ``moe.chunk_bytes``) when the size is not positive or smaller than one
    element, or when ``order`` is not a permutation.
    """
    if len(numels) != len(dtypes) or (phases is not None and len(phases) != len(numels)):
        raise ValueError("plan_chunks: need one dtype (and phase) per parameter")
    if chunk_bytes <= 0:
        raise ValueError(f"moe.chunk_bytes must be > 0, got {chunk_bytes}")
    walk = list(reversed(range(len(numels)))) if order is None else list(order)
    if sorted(walk) != list(range(len(numels))):
        raise ValueError(f"plan_chunks: order must be a permutation of 0..{len(numels) - 1}")
    for dtype in set(dtypes):
        if chunk_bytes // dtype.itemsize < 1:
            raise ValueError(
                f"moe.chunk_bytes={chunk_bytes} is smaller than one {dtype} element "
                f"({dtype.itemsize} bytes)"
            )
    if phases is not None:
        runs = phase_runs(numels, dtypes, chunk_bytes, walk, phases)
        return tuple(_even_cuts(numels, dtypes, chunk_bytes, runs))
    chunks: list[Chunk] = []
    segments: list[Segment] = []
    room, current = 0, None
    for param in walk:
        dtype = dtypes[param]
        capacity = chunk_bytes // dtype.itemsize
        start = 0
        while start < numels[param]:
            if room == 0 or dtype != current:
                if segments:
                    chunks.append(Chunk(len(chunks), tuple(segments), current))  # type: ignore[arg-type]
                segments, room, current = [], capacity, dtype
            stop = min(numels[param], start + room)
            segments.append(Segment(param, start, stop))
            room -= stop - start
            start = stop
    if segments:
        chunks.append(Chunk(len(chunks), tuple(segments), current))  # type: ignore[arg-type]
    return tuple(chunks)


SMALL_PHASE = 0.25
"""A phase whose gradient is under this fraction of a chunk joins the next phase's chunks: a
chunk of its own would pay a whole ``alpha`` for a few bytes (a router's weight, a norm)."""


def phase_runs(
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    chunk_bytes: int,
    walk: Sequence[int],
    phases: Sequence[int],
) -> list[list[int]]:
    """``walk`` (parameter indices) cut into runs of consecutive parameters of one dtype that
    become ready together (pure). A run ends where the walk's phase label or dtype changes,
    except that a run of fewer than ``SMALL_PHASE * chunk_bytes`` bytes continues into the next
    phase (not across a dtype change). Why: a chunk launches only when all its gradients are
    ready, so a chunk spanning two phases waits for the later one; at the end of backward that
    wait is exposed (a 262 KiB expert chunk holding a third of the last layer's gradient and
    two thirds of the layer before it went out only after the last layer's backward)."""
    runs: list[list[int]] = []
    run: list[int] = []
    for param in walk:
        if run:
            last = run[-1]
            changed = phases[param] != phases[last]
            small = sum(numels[i] for i in run) * dtypes[last].itemsize < SMALL_PHASE * chunk_bytes
            if dtypes[param] != dtypes[last] or (changed and not small):
                runs.append(run)
                run = []
        run.append(param)
    if run:
        runs.append(run)
    return runs


def _even_cuts(
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    chunk_bytes: int,
    runs: Sequence[Sequence[int]],
) -> list[Chunk]:
    """Each run (one dtype) cut into the fewest chunks of at most ``chunk_bytes``, as even as
    whole elements allow (sizes differ by at most one element), in walk order."""
    chunks: list[Chunk] = []
    for run in runs:
        dtype = dtypes[run[0]]
        total = sum(numels[i] for i in run)
        if total == 0:
            continue  # only empty parameters: nothing to reduce
        count = -(-total // (chunk_bytes // dtype.itemsize))
        sizes = [total // count + (1 if k < total % count else 0) for k in range(count)]
        pieces = ((param, 0, numels[param]) for param in run)
        param, start, stop = next(pieces)
        for size in sizes:
            segments: list[Segment] = []
            while size > 0:
                while start == stop:  # an empty parameter contributes no segment
                    param, start, stop = next(pieces)
                take = min(size, stop - start)
                segments.append(Segment(param, start, start + take))
                start, size = start + take, size - take
            chunks.append(Chunk(len(chunks), tuple(segments), dtype))
    return chunks


def chunking_cost(total_bytes: int, count: int, alpha_s: float, beta: float, waits: float) -> float:
    """Predicted cost (s) of reducing ``total_bytes`` in ``count`` equal chunks (pure; see the
    module): every chunk pays ``alpha`` once, the bytes pay ``1 / beta`` once, and ``waits``
    a2a's per step each wait for one whole chunk on the wire."""
    if count < 1:
        raise ValueError(f"chunking_cost: count must be >= 1, got {count}")
    return _priced(count, total_bytes, total_bytes / count, alpha_s, beta, waits)


def _priced(
    count: int, total_bytes: float, largest: float, alpha_s: float, beta: float, waits: float
) -> float:
    """Seconds of ``count`` chunks of ``total_bytes``: ``alpha`` each, the bytes at ``beta``,
    and ``waits`` a2a's that each wait for the ``largest`` chunk on the wire."""
    return count * alpha_s + total_bytes / beta + waits * (alpha_s + largest / beta)


def choose_chunk_bytes(
    total_bytes: int,
    alpha_s: float,
    beta_bytes_per_s: float,
    *,
    itemsize: int = 1,
    waits: float = 1.0,
    slack: float = 0.1,
    min_bytes: int = 1,
    max_bytes: int | None = None,
) -> int:
    """Chunk size (bytes, a multiple of ``itemsize``) for a gradient of ``total_bytes`` from a
    profile ``alpha_s``, ``beta_bytes_per_s`` (pure; see the module): of the chunk counts whose
    even chunks lie in ``[min_bytes, max_bytes]``, the fewest (the largest chunks) whose
    :func:`chunking_cost` is within ``slack`` of the cheapest count's. Returns the even size
    ``ceil(total / count)`` rounded up to whole elements, for :func:`even_chunk_bytes` and
    :func:`plan_chunks`. ValueError for a non-positive size, bounds or profile."""
    if total_bytes <= 0 or itemsize <= 0 or min_bytes <= 0:
        raise ValueError("choose_chunk_bytes: total_bytes, itemsize and min_bytes must be > 0")
    if alpha_s < 0 or beta_bytes_per_s <= 0 or waits < 0 or slack < 0:
        raise ValueError("choose_chunk_bytes: need alpha, waits, slack >= 0 and beta > 0")
    most = max_bytes if max_bytes is not None else total_bytes
    if most < min_bytes:
        raise ValueError(f"choose_chunk_bytes: max_bytes {most} < min_bytes {min_bytes}")
    fewest = max(1, -(-total_bytes // most))
    most_count = max(fewest, total_bytes // min_bytes)

    def cost(count: int) -> float:
        return chunking_cost(total_bytes, count, alpha_s, beta_bytes_per_s, waits)

    # cost(k) = k * alpha + waits * N / (k * beta) + const is convex in k, least at
    # k* = sqrt(waits * N / (alpha * beta)); it falls from `fewest` to the best count
    spread = waits * total_bytes / beta_bytes_per_s
    ideal = math.sqrt(spread / alpha_s) if alpha_s > 0 else math.inf
    if ideal >= most_count:
        best = most_count
    else:
        near = {min(most_count, max(fewest, k)) for k in (math.floor(ideal), math.ceil(ideal))}
        best = min(near, key=cost)
    bound = (1 + slack) * cost(best)
    low, high = fewest, best  # the fewest chunks within the bound: bisection on the fall
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if cost(mid) <= bound else (mid + 1, high)
    count = low
    elements = -(-total_bytes // itemsize)
    return -(-elements // count) * itemsize


def even_chunk_bytes(total_bytes: int, size: int, itemsize: int, min_count: int = 1) -> int:
    """The chunk size that cuts a gradient of ``total_bytes`` into ``count = max(min_count,
    total_bytes // size)`` nearly equal chunks of ``itemsize``-byte elements (pure; see the
    module), for :func:`plan_chunks`. Every chunk but the last holds the returned size: with
    ``min_count`` 1, at least ``size`` when ``total_bytes >= size``, and less than ``2 * size +
    itemsize``. The last holds the rest (for a gradient of more than ``count ** 2`` elements,
    fewer than ``count`` elements less). A gradient smaller than ``size`` is one chunk, unless
    ``min_count`` asks for more (at most one per element)."""
    if size <= 0 or itemsize <= 0:
        raise ValueError(f"moe.chunk_bytes must be > 0, got {size}")
    if min_count < 1:
        raise ValueError(f"even_chunk_bytes: min_count must be >= 1, got {min_count}")
    elements = max(1, -(-total_bytes // itemsize))
    count = min(elements, max(min_count, total_bytes // size))
    return -(-elements // count) * itemsize


def choose_run_chunk_bytes(
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    alpha_s: float,
    beta_bytes_per_s: float,
    *,
    order: Sequence[int] | None = None,
    phases: Sequence[int] | None = None,
    waits: float = 1.0,
    slack: float = 0.1,
    min_bytes: int = 1,
    max_bytes: int,
) -> int:
    """Chunk size for :func:`plan_chunks` over these parameters, ``order`` and ``phases``,
    judged by the chunks that plan really makes (pure).

    :func:`choose_chunk_bytes` prices ``count`` even chunks of the whole gradient; a plan with
    phases cuts each phase run apart and may join a small one to the next, so a size makes
    other counts and chunk sizes than it priced (``bench moe``: 2 chunks priced, 3 made). Here
    each candidate size is planned and priced as :func:`chunking_cost` prices a plan: every
    chunk pays ``alpha``, the bytes ``1 / beta``, and ``waits`` a2a's per step wait for the
    largest chunk. Of the sizes within ``slack`` of the least cost, the plan with the fewest
    chunks wins, then the larger size. Candidates, within ``[min_bytes, max_bytes]``: ``max_bytes``,
    every even cut ``ceil(bytes / n)`` of each phase run and of the whole gradient, and the
    sizes past which consecutive runs count as small (:data:`SMALL_PHASE`) and join the next.
    ValueError for a non-positive profile or bounds.
    """
    if alpha_s < 0 or beta_bytes_per_s <= 0 or waits < 0 or slack < 0:
        raise ValueError("choose_run_chunk_bytes: need alpha, waits, slack >= 0 and beta > 0")
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"choose_run_chunk_bytes: bounds [{min_bytes}, {max_bytes}]")
    total = sum(n * d.itemsize for n, d in zip(numels, dtypes, strict=True))
    if total == 0:
        return max_bytes
    walk = list(reversed(range(len(numels)))) if order is None else list(order)
    labels = list(phases) if phases is not None else [0] * len(numels)
    sizes = _candidate_sizes(numels, dtypes, walk, labels, total, (min_bytes, max_bytes))
    priced = [
        (_plan_cost(numels, dtypes, size, walk, labels, alpha_s, beta_bytes_per_s, waits), size)
        for size in sorted(sizes)
    ]
    least = min(cost for (cost, _), _ in priced)
    fits = [(count, -size) for (cost, count), size in priced if cost <= (1 + slack) * least]
    return -min(fits)[1]


def _candidate_sizes(
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    walk: Sequence[int],
    labels: Sequence[int],
    total: int,
    bounds: tuple[int, int],
) -> set[int]:
    """The sizes :func:`choose_run_chunk_bytes` prices (see there), in whole elements, within
    ``bounds`` (least, most bytes); ``total``: the gradient's bytes."""
    min_bytes, max_bytes = bounds
    unit = max(d.itemsize for d in dtypes)
    runs = [
        sum(numels[i] * dtypes[i].itemsize for i in run)
        for run in phase_runs(numels, dtypes, 1, walk, labels)
    ]
    # Where a plan can change: even cuts of a run or of everything, and the sizes above which
    # consecutive runs together count as small (they then join the next phase).
    cuts = [-(-whole // n) for whole in [total, *runs] for n in range(1, whole // min_bytes + 1)]
    joins = [
        int(sum(runs[i : j + 1]) / SMALL_PHASE) + 1
        for i in range(len(runs))
        for j in range(i, len(runs))
    ]
    sizes = {max_bytes}
    for size in cuts + joins:
        size = -(-size // unit) * unit  # whole elements
        if min_bytes <= size <= max_bytes:
            sizes.add(size)
    return sizes


def _plan_cost(
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    size: int,
    walk: Sequence[int],
    labels: Sequence[int],
    alpha_s: float,
    beta: float,
    waits: float,
) -> tuple[float, int]:
    """(cost, chunk count) of :func:`plan_chunks` at ``size`` (see
    :func:`choose_run_chunk_bytes`)."""
    chunks = plan_chunks(numels, dtypes, size, walk, labels)
    sizes = [c.numel * c.dtype.itemsize for c in chunks]
    return _priced(len(sizes), sum(sizes), max(sizes), alpha_s, beta, waits), len(sizes)
