"""Resizable 2D tensor parallelism: place devices on a q x q mesh and size its blocks (pure).

Rank (i, j) of a 2D mesh computes every linear on its batch share b_i and its column's output
width, which is a_j whole heads (attention, QKV, projection) and proportional MLP and vocabulary
blocks (``ffn_j = ffn a_j / heads``, ``v_j = V a_j / heads``, rounded). So its compute is
proportional to b_i a_j, and every SUMMA step waits for the slowest block:

    step ~ max over (i, j) of  b_i a_j / speed(device at (i, j)).

``plan_resizable_2d`` minimises that over device placements, batch shares and head counts:

* for a fixed placement and fixed batch shares, column j's time is a_j / c_j with
  c_j = min_i speed_ij / b_i; handing out heads one at a time to the column whose time after
  the hand-out is smallest is optimal (a min-max allocation with a linear cost per unit);
* batch shares are enumerated (every split of the batch over the q rows, zeros allowed);
* placements are enumerated up to row and column permutations (permuting rows permutes the
  batch shares with them, so one placement per class is enough): exact for small meshes,
  within ``max_evaluations``; larger meshes get a pairwise-swap local search from a
  speed-sorted start (not proven optimal: the docstring says so where it is used).

``place_2d`` in ``tp2d_cost`` is the brute force over every permutation and every pair of
splits that the tests check this against.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Resizable2D:
    """Devices on mesh positions and the block sizes of every mesh row and column.

    ``positions[p]``: the device (index into the speeds, a global rank of the TP group) at
    mesh position p = i * q + j. ``slowest``: max_ij (overhead + b_i a_j) / speed, in
    sample-heads per unit speed; ``even_slowest``: the same for even blocks with devices in
    order.
    """

    positions: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    head_counts: tuple[int, ...]
    ffn_sizes: tuple[int, ...]
    vocab_sizes: tuple[int, ...]
    slowest: float
    even_slowest: float
    exact: bool

    @property
    def q(self) -> int:
        return math.isqrt(len(self.positions))

    @property
    def predicted_speedup(self) -> float:
        """Even layout's slowest block over this one's (compute only)."""
        return self.even_slowest / self.slowest

    def placement(self) -> dict[int, tuple[int, int]]:
        """Device (global rank) -> mesh position (i, j), as ``Mesh2D.build`` takes it."""
        return {device: divmod(p, self.q) for p, device in enumerate(self.positions)}


def proportional(total: int, weights: Sequence[int]) -> tuple[int, ...]:
    """``total`` split in proportion to ``weights`` (largest remainder; ties to the lower
    index); all zero weights: ValueError."""
    weight = sum(weights)
    if weight <= 0 or min(weights) < 0:
        raise ValueError(f"cannot split {total} in proportion to {list(weights)}")
    exact = [total * w / weight for w in weights]
    sizes = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda k: (sizes[k] - exact[k], k))
    for k in order[: total - sum(sizes)]:
        sizes[k] += 1
    return tuple(sizes)


def best_heads(capacities: Sequence[float], heads: int) -> tuple[tuple[int, ...], float]:
    """Head counts minimising max_j a_j / c_j (greedy hand-out, optimal) and that maximum.

    A column of capacity 0 (a row share with no speed behind it cannot happen: speeds > 0;
    capacity is inf when every b_i is 0) gets heads only when nothing else can.
    """
    counts = [0] * len(capacities)
    for _ in range(heads):
        j = min(range(len(counts)), key=lambda k: ((counts[k] + 1) / capacities[k], k))
        counts[j] += 1
    worst = max((a / c for a, c in zip(counts, capacities, strict=True) if a), default=0.0)
    return tuple(counts), worst


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(total,)]
    return [(k, *rest) for k in range(total + 1) for rest in _compositions(total - k, parts - 1)]


def _capacities(speeds: Sequence[float], positions: Sequence[int], batch: Sequence[int]):
    q = len(batch)
    caps = []
    for j in range(q):
        loads = [batch[i] / speeds[positions[i * q + j]] for i in range(q)]
        caps.append(math.inf if max(loads) == 0 else 1.0 / max(loads))
    return caps


def affine_heads(
    speeds: Sequence[float],
    positions: Sequence[int],
    batch: Sequence[int],
    heads: int,
    overhead: float,
) -> tuple[tuple[int, ...], float]:
    """Head counts minimising the slowest block under ``(overhead + b_i a_j) / speed`` and
    that time (every block pays the overhead, an empty one too).

    Column j's time is non-decreasing in a_j, so handing out heads one at a time to the
    column whose time after the hand-out is smallest is optimal (min-max allocation).
    """
    q = len(batch)

    def column(j: int, a: int) -> float:
        return max((overhead + batch[i] * a) / speeds[positions[i * q + j]] for i in range(q))

    counts = [0] * q
    for _ in range(heads):
        j = min(range(q), key=lambda k: (column(k, counts[k] + 1), k))
        counts[j] += 1
    return tuple(counts), max(column(j, counts[j]) for j in range(q))


def slowest_block(
    speeds: Sequence[float],
    positions: Sequence[int],
    batch: Sequence[int],
    heads: Sequence[int],
    overhead: float = 0.0,
) -> float:
    """max over mesh blocks of (overhead + b_i a_j) / speed of the device at (i, j)."""
    q = len(batch)
    return max(
        (overhead + batch[i] * heads[j]) / speeds[positions[i * q + j]]
        for i in range(q)
        for j in range(q)
    )


def _best_for_placement(
    speeds: Sequence[float],
    positions: Sequence[int],
    batches: list[tuple[int, ...]],
    heads: int,
    overhead: float = 0.0,
) -> tuple[float, tuple[int, ...], tuple[int, ...]]:
    best: tuple[float, tuple[int, ...], tuple[int, ...]] | None = None
    for b in batches:
        if overhead:
            a, worst = affine_heads(speeds, positions, b, heads, overhead)
        else:
            a, worst = best_heads(_capacities(speeds, positions, b), heads)
        if best is None or worst < best[0] - 1e-12:
            best = (worst, b, a)
    assert best is not None
    return best


def _canonical_placements(q: int) -> list[tuple[int, ...]]:
    """One placement per class under row and column permutations: the rows sorted by their
    smallest device, the first row's devices ascending."""
    out = []
    for perm in itertools.permutations(range(q * q)):
        rows = [perm[i * q : (i + 1) * q] for i in range(q)]
        if list(rows[0]) != sorted(rows[0]):
            continue
        if [min(r) for r in rows] != sorted(min(r) for r in rows):
            continue
        # Column order is fixed by the first row; rows by their minima: one per class.
        out.append(perm)
    return out


def plan_resizable_2d(
    speeds: Sequence[float],
    batch: int,
    heads: int,
    ffn: int,
    vocab: int,
    *,
    max_evaluations: int = 300_000,
    even_rows: bool = False,
    overhead: float = 0.0,
) -> Resizable2D:
    """The placement and block sizes minimising the slowest block (see the module docstring).

    ``speeds``: one per device of the TP group (q * q of them, > 0). Exact when the search fits
    ``max_evaluations`` (placement classes x batch splits); else local search (``exact`` False).
    ``even_rows``: keep the batch split even (only placement and column widths are planned),
    for a batch size not known when planning. ``overhead``: work every rank does whatever its
    block (host-side dispatch, the embedding's full-batch lookup, ...), in sample-heads, the
    unit of b_i a_j: blocks then take (overhead + b_i a_j) / speed (``bench tp2d`` measures it;
    0 is the proportional model). ValueError, naming the field, when the group is not a square
    or a speed is not positive.
    """
    n = len(speeds)
    q = math.isqrt(n)
    if n == 0 or q * q != n:
        raise ValueError(f"parallel.tp: 2D tensor parallelism needs a square size, got {n}")
    if min(speeds) <= 0:
        raise ValueError(f"cluster.devices: speeds must be > 0, got {list(speeds)}")
    if batch < 1 or heads < 1:
        raise ValueError(f"2D plan needs batch >= 1 and heads >= 1, got {batch}, {heads}")
    batches = [_even(batch, q)] if even_rows else _compositions(batch, q)
    classes = math.factorial(n) // (math.factorial(q) ** 2)
    exact = classes * len(batches) <= max_evaluations
    if exact:
        candidates = _canonical_placements(q)
        scored = [(_best_for_placement(speeds, p, batches, heads, overhead), p) for p in candidates]
        (worst, b, a), positions = min(scored, key=lambda item: item[0][0])
    else:
        (worst, b, a), positions = _local_search(speeds, q, batches, heads, overhead)
    even, even_heads = _even(batch, q), _even(heads, q)
    return Resizable2D(
        positions=tuple(positions),
        batch_sizes=b,
        head_counts=a,
        ffn_sizes=proportional(ffn, a),
        vocab_sizes=proportional(vocab, a),
        slowest=worst,
        even_slowest=slowest_block(speeds, tuple(range(n)), even, even_heads, overhead),
        exact=exact,
    )


def _even(total: int, parts: int) -> tuple[int, ...]:
    """Sizes differing by at most one, larger first (``tp2d.layout.even_sizes``)."""
    base, extra = divmod(total, parts)
    return tuple(base + (1 if k < extra else 0) for k in range(parts))


def _local_search(
    speeds: Sequence[float],
    q: int,
    batches: list[tuple[int, ...]],
    heads: int,
    overhead: float = 0.0,
):
    """Pairwise swaps from devices sorted fastest first, row-major; first improvement."""
    positions = sorted(range(q * q), key=lambda d: (-speeds[d], d))
    best = _best_for_placement(speeds, positions, batches, heads, overhead)
    improved = True
    while improved:
        improved = False
        for x, y in itertools.combinations(range(q * q), 2):
            trial = list(positions)
            trial[x], trial[y] = trial[y], trial[x]
            score = _best_for_placement(speeds, trial, batches, heads, overhead)
            if score[0] < best[0] - 1e-12:
                positions, best, improved = trial, score, True
    return best, positions


@dataclass(frozen=True)
class Tp2dPlan:
    """``plan.tp2d`` as the planner writes it and the plugin applies it (every TP group alike).

    ``batch_sizes``: samples per mesh row of one data-parallel batch (empty: split evenly at
    run time); ``head_counts`` / ``ffn_sizes`` / ``vocab_sizes``: per mesh column.
    ``index_positions[k]``: the mesh position (i, j) of the k-th rank of every TP group (its
    ranks in ascending order, the order Colossal-AI's process-group mesh gives them), so that a
    data-parallel group (the k-th ranks of all TP groups) holds blocks of one shape.
    ``speeds[k]``: the slowest k-th device over the data-parallel replicas, what was planned for.
    """

    batch_sizes: tuple[int, ...]
    head_counts: tuple[int, ...]
    ffn_sizes: tuple[int, ...]
    vocab_sizes: tuple[int, ...]
    index_positions: tuple[tuple[int, int], ...]
    speeds: tuple[float, ...]
    predicted_speedup: float
    exact: bool

    @property
    def tp2d(self) -> Tp2dPlan:
        """Itself: a Tp2dPlan can be passed wherever a plan carrying ``tp2d`` is taken."""
        return self

    def placement_of(self, tp_rank_lists: Sequence[Sequence[int]]) -> dict[int, tuple[int, int]]:
        """Global rank -> mesh position for every TP group (each a list of global ranks)."""
        out: dict[int, tuple[int, int]] = {}
        for ranks in tp_rank_lists:
            ordered = sorted(int(r) for r in ranks)
            if len(ordered) != len(self.index_positions):
                raise ValueError(
                    f"parallel.tp: the 2D plan is for TP groups of {len(self.index_positions)} "
                    f"ranks, got {ordered}"
                )
            out.update(zip(ordered, self.index_positions, strict=True))
        return out

    def to_dict(self) -> dict[str, object]:
        """A JSON/YAML-ready record (lists, not tuples)."""
        return {
            "batch_sizes": list(self.batch_sizes),
            "head_counts": list(self.head_counts),
            "ffn_sizes": list(self.ffn_sizes),
            "vocab_sizes": list(self.vocab_sizes),
            "index_positions": [list(p) for p in self.index_positions],
            "speeds": list(self.speeds),
            "predicted_speedup": self.predicted_speedup,
            "exact": self.exact,
        }

    def summary(self) -> str:
        """One line for the console."""
        rows = list(self.batch_sizes) if self.batch_sizes else "even"
        return (
            f"resizable 2D: TP ranks at mesh positions {[list(p) for p in self.index_positions]}"
            f" (by rank in the TP group), batch {rows} per row, heads {list(self.head_counts)} / "
            f"MLP {list(self.ffn_sizes)} / vocab {list(self.vocab_sizes)} per column; "
            f"{self.predicted_speedup:.2f}x even 2D predicted (compute)"
        )


def plan_tp2d(
    speeds_by_rank: Sequence[float],
    tp_rank_lists: Sequence[Sequence[int]],
    batch: int | None,
    heads: int,
    ffn: int,
    vocab: int,
    *,
    overhead: float = 0.0,
    head_unit: int = 1,
) -> Tp2dPlan:
    """The 2D plan for a world whose rank r has speed ``speeds_by_rank[r]``.

    Every TP group gets the same block sizes and the same positions by rank order (data
    parallelism needs equal shapes down each data-parallel group), planned for the slowest
    device at each TP index over the replicas. ``batch``: samples per data-parallel batch, or
    None when unknown (rows stay even, ``batch_sizes`` empty). ValueError naming the field on a
    non-square group or a rank without a speed. ``overhead``: see ``plan_resizable_2d``.
    ``head_unit``: every column's head count is a multiple of it (``dims_2d``: Llama's query
    heads per key/value head); planned in units of that many heads.
    """
    lists = [sorted(int(r) for r in ranks) for ranks in tp_rank_lists]
    if not lists:
        raise ValueError("parallel.tp: no TP groups to plan")
    missing = [r for ranks in lists for r in ranks if r >= len(speeds_by_rank)]
    if missing:
        raise ValueError(
            f"cluster.devices: {len(speeds_by_rank)} devices listed, none for ranks {missing}"
        )
    size = len(lists[0])
    speeds = tuple(min(speeds_by_rank[ranks[k]] for ranks in lists) for k in range(size))
    if head_unit < 1 or heads % head_unit:
        raise ValueError(f"model.hf: {heads} heads are not whole groups of {head_unit}")
    planned = plan_resizable_2d(
        speeds,
        batch or math.isqrt(size),
        heads // head_unit,  # (o + b a) / s = unit (o / unit + b groups) / s: same optimum
        ffn,
        vocab,
        even_rows=batch is None,
        overhead=overhead / head_unit,
    )
    q = planned.q
    return Tp2dPlan(
        batch_sizes=planned.batch_sizes if batch is not None else (),
        head_counts=tuple(a * head_unit for a in planned.head_counts),
        ffn_sizes=planned.ffn_sizes,
        vocab_sizes=planned.vocab_sizes,
        index_positions=tuple(divmod(planned.positions.index(k), q) for k in range(size)),
        speeds=speeds,
        predicted_speedup=planned.predicted_speedup,
        exact=planned.exact,
    )


def dims_2d(hf_config: Any) -> tuple[int, int, int, int]:
    """(heads, MLP width, vocabulary or classes, head unit) that ``plan_tp2d`` sizes for a
    model 2D converts (GPT-2, Llama, ViT; ``tp2d.convert.SUPPORTED_2D``). Head unit: Llama's
    query heads per key/value head (mesh column j holds a_j kv / heads key/value heads, so
    a_j must be a multiple of heads / gcd(heads, kv)), else 1. ViT's columns split its
    classes. ValueError naming ``model.arch`` for another model."""
    kind = getattr(hf_config, "model_type", None)
    if kind == "gpt2":
        ffn = hf_config.n_inner or 4 * hf_config.n_embd
        return hf_config.n_head, ffn, hf_config.vocab_size, 1
    if kind in ("llama", "vit"):
        heads = hf_config.num_attention_heads
        ffn = hf_config.intermediate_size
        if kind == "vit":
            return heads, ffn, hf_config.num_labels, 1
        kv = getattr(hf_config, "num_key_value_heads", None) or heads
        return heads, ffn, hf_config.vocab_size, heads // math.gcd(heads, kv)
    raise ValueError(f"model.arch: resizable 2D plans gpt2, llama and vit, got {kind!r}")
