"""Per-layer cost of 1D (Megatron) against 2D (SUMMA) tensor parallelism, per rank (pure).

One pre-norm transformer layer (LN, QKV h -> 3h, attention, proj h -> h, LN, fc1 h -> f,
fc2 f -> h; GPT-2), micro-batch b, sequence s, hidden h, a heads, MLP width f. Per rank:

* parameters (elements): weights and vectors the rank holds;
* activation bytes saved for the backward (Korthikanti et al. 2022's accounting, generalised
  to ``elem_bytes`` and optional dropout): elements 16 sbh + as^2 b (x2 with attention
  dropout), plus 1-byte dropout masks 2 sbh + as^2 b. With 2-byte elements and dropout this is
  their sbh (34 + 5 as / h). 1D keeps LN inputs, the QKV and fc1 inputs (4 sbh elements) and
  the output dropout masks whole on every rank: sbh (10 + 24 / P) + 5 as^2 b / P. With
  sequence parallelism everything is split by P. 2D splits everything: rank (i, j) holds the
  b_i / b batch share and h_j / h of the hidden (a_j / a of the heads);
* collectives, forward + backward, of a layer whose input needs a gradient: per (op, axis)
  the number of calls and the elements passed to them on this rank, exactly as
  ``colossal_hetero.tp2d.Block2D`` (2D) and Megatron's mappings (1D) issue them;
* bandwidth words: what a rank moves, counting a (pipelined) broadcast or reduce of n words
  as n and a ring all-reduce over g ranks as 2 (g - 1) / g * n.

2D per Linear2D in -> out (m = b_i s tokens, K = in, n_j its output width): forward summa_ab,
backward summa_abt (dx) and summa_atb (dW): 4q broadcasts (2 m K on the row, 2 K n_j on the
column), 2q reduces (m K on the row, K n_j on the column) and the bias gradient's column
all-reduce (n_j). Evenly, the four linears move 3 (7 bsh + 12 h^2) / q words (Optimus' 2D),
against 1D's four all-reduces of bsh, 8 bsh (P - 1) / P: 2D traffic falls as 1 / sqrt(p) but
moves weights too, so it loses when bs is small against h.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

Key = tuple[str, str]  # (op: broadcast | reduce | all_reduce, axis: row | col | tp)


@dataclass(frozen=True)
class LayerDims:
    """One transformer layer's sizes (``ffn`` default 4 * hidden)."""

    batch: int
    seq: int
    hidden: int
    heads: int
    ffn: int = 0
    elem_bytes: int = 2
    dropout: bool = True

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"model hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.hidden)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class Shares2D:
    """A q x q mesh's block sizes: batch per mesh row, heads and MLP width per mesh column."""

    batch_sizes: tuple[int, ...]
    head_counts: tuple[int, ...]
    ffn_sizes: tuple[int, ...]

    @classmethod
    def even(cls, dims: LayerDims, q: int) -> Shares2D:
        """Equal blocks; ValueError naming what the even layout cannot divide."""
        for name, value in (("batch", dims.batch), ("heads", dims.heads), ("ffn", dims.ffn)):
            if value % q:
                raise ValueError(
                    f"2D tensor parallelism with q={q} needs {name} % q == 0, got {value}"
                )
        return cls((dims.batch // q,) * q, (dims.heads // q,) * q, (dims.ffn // q,) * q)


@dataclass
class Comm:
    """Collectives of a layer on one rank: (op, axis) -> [calls, elements]."""

    calls: dict[Key, list[int]] = field(default_factory=dict)
    group_sizes: dict[str, int] = field(default_factory=dict)

    def add(self, op: str, axis: str, elements: int, times: int = 1) -> None:
        if elements <= 0:
            return  # an empty block is skipped on every rank
        entry = self.calls.setdefault((op, axis), [0, 0])
        entry[0] += times
        entry[1] += elements * times

    def bandwidth_words(self) -> float:
        """Words a rank moves: n per broadcast/reduce, 2 (g - 1) / g n per ring all-reduce,
        (g - 1) / g n per all-gather or reduce-scatter of a full tensor of n words."""
        total = 0.0
        for (op, axis), (_, words) in self.calls.items():
            g = self.group_sizes[axis]
            ring = {"all_reduce": 2 * (g - 1) / g, "all_gather": (g - 1) / g}
            ring["reduce_scatter"] = ring["all_gather"]
            total += words * ring.get(op, 1.0)
        return total


@dataclass(frozen=True)
class LayerCost:
    mode: str
    params: int
    activation_bytes: float
    comm: Comm

    def comm_bytes(self, elem_bytes: int) -> float:
        return self.comm.bandwidth_words() * elem_bytes


def activation_bytes(dims: LayerDims, *, tokens: float, hidden: float, score: float) -> float:
    """Saved bytes of one layer for ``tokens`` = s b, ``hidden`` = h, ``score`` = a s^2 b."""
    e, drop = dims.elem_bytes, int(dims.dropout)
    elements = 16 * tokens * hidden + score * (1 + drop)
    masks = drop * (2 * tokens * hidden + score)
    return e * elements + masks


def cost_1d(dims: LayerDims, tp: int, *, sequence_parallel: bool = False) -> LayerCost:
    """Megatron 1D over ``tp`` ranks (heads, ffn divisible by tp)."""
    b, s, h, a, f = dims.batch, dims.seq, dims.hidden, dims.heads, dims.ffn
    if a % tp or f % tp:
        raise ValueError(f"1D tensor parallelism needs heads and ffn divisible by tp={tp}")
    params = (3 * h * h + h * h + h * f + f * h) // tp + (3 * h + f) // tp + 2 * h + 4 * h
    score = a * s * s * b / tp
    if sequence_parallel:
        act = activation_bytes(dims, tokens=s * b / tp, hidden=h, score=0) + _score_bytes(
            dims, score
        )
    else:
        replicated = dims.elem_bytes * 4 * s * b * h + int(dims.dropout) * 2 * s * b * h
        act = replicated + dims.elem_bytes * 12 * s * b * h / tp + _score_bytes(dims, score)
    comm = Comm(group_sizes={"tp": tp})
    if tp > 1:
        if sequence_parallel:  # all-gather + reduce-scatter pairs: same words as all-reduces
            comm.add("all_gather", "tp", s * b * h, times=4)
            comm.add("reduce_scatter", "tp", s * b * h, times=4)
        else:
            comm.add("all_reduce", "tp", s * b * h, times=4)
    return LayerCost("1d-sp" if sequence_parallel else "1d", params, act, comm)


def _score_bytes(dims: LayerDims, score: float) -> float:
    drop = int(dims.dropout)
    return dims.elem_bytes * score * (1 + drop) + drop * score


def cost_2d(dims: LayerDims, shares: Shares2D, i: int = 0, j: int = 0) -> LayerCost:
    """SUMMA 2D on a q x q mesh with ``shares``, for the rank at mesh position (i, j)."""
    q = len(shares.batch_sizes)
    d = dims.head_dim
    widths = [c * d for c in shares.head_counts]
    _check_shares(dims, shares, widths)
    m, hj, fj = shares.batch_sizes[i] * dims.seq, widths[j], shares.ffn_sizes[j]
    comm = Comm(group_sizes={"row": q, "col": q})
    ffn = list(shares.ffn_sizes)
    if q > 1:  # QKV, proj, fc1, fc2: (input sizes over the mesh, output width of column j)
        for in_sizes, n in ((widths, 3 * hj), (widths, hj), (widths, fj), (ffn, hj)):
            _linear_comm(comm, m, in_sizes, n)
    params = _weight_params(widths, ffn, i, j, hj, fj)
    if q > 1:
        for _ in range(2):  # 2 LayerNorm2D: mean and variance forward, both sums backward
            comm.add("all_reduce", "row", m, times=2)
            comm.add("all_reduce", "row", 2 * m)
            comm.add("all_reduce", "col", hj, times=2)  # gain and shift gradients
    score = shares.head_counts[j] * dims.seq * dims.seq * shares.batch_sizes[i]
    act = activation_bytes(dims, tokens=m, hidden=hj, score=score)
    return LayerCost("2d", params, act, comm)


def _weight_params(widths: list[int], ffn: list[int], i: int, j: int, hj: int, fj: int) -> int:
    """Weights [in_i, out_j] of QKV, proj, fc1, fc2, plus 4 biases and 2 LNs down column j."""
    weights = widths[i] * 3 * hj + widths[i] * hj + widths[i] * fj + ffn[i] * hj
    return weights + (3 * hj + hj + fj + hj) + 4 * hj


def _linear_comm(comm: Comm, m: int, in_sizes: Sequence[int], n: int) -> None:
    """One Linear2D's forward + backward collectives on this rank (see the module docstring)."""
    for k in in_sizes:
        comm.add("broadcast", "row", m * k, times=2)  # x blocks: forward ab, backward atb
        comm.add("broadcast", "col", k * n, times=2)  # W blocks: forward ab, backward abt
        comm.add("reduce", "row", m * k)  # dx partials (abt)
        comm.add("reduce", "col", k * n)  # dW partials (atb)
    comm.add("all_reduce", "col", n)  # bias gradient


def _check_shares(dims: LayerDims, shares: Shares2D, widths: list[int]) -> None:
    q = len(shares.batch_sizes)
    if q * q == 0 or math.isqrt(q * q) != q:
        raise ValueError("2D shares need q >= 1")
    for name, sizes, total in (
        ("batch_sizes", shares.batch_sizes, dims.batch),
        ("head_counts", shares.head_counts, dims.heads),
        ("ffn_sizes", shares.ffn_sizes, dims.ffn),
    ):
        if len(sizes) != q or sum(sizes) != total or min(sizes) < 0:
            raise ValueError(f"2D {name} {list(sizes)} must be {q} sizes >= 0 summing to {total}")
    assert sum(widths) == dims.hidden


def compare(dims: LayerDims, tp: int) -> dict[str, LayerCost]:
    """1D, 1D with sequence parallelism and even 2D (rank (0, 0)) at the same TP size."""
    q = math.isqrt(tp)
    if q * q != tp:
        raise ValueError(f"parallel.tp: 2D tensor parallelism needs a square size, got {tp}")
    return {
        "1d": cost_1d(dims, tp),
        "1d-sp": cost_1d(dims, tp, sequence_parallel=True),
        "2d": cost_2d(dims, Shares2D.even(dims, q)),
    }


@dataclass(frozen=True)
class Placement2D:
    """Devices on mesh positions and block sizes; ``slowest`` = max_ij b_i a_j / speed_ij."""

    positions: tuple[int, ...]  # device index at mesh position i * q + j
    batch_sizes: tuple[int, ...]
    head_counts: tuple[int, ...]
    slowest: float


def block_time(
    speeds: Sequence[float], positions: Sequence[int], batch: Sequence[int], heads: Sequence[int]
) -> float:
    """max over mesh blocks of b_i a_j / speed of the device at (i, j) (work per unit speed).

    Every linear of rank (i, j) costs b_i s in out_j, so its time is proportional to
    b_i a_j (out_j in whole heads) over the device's speed; a SUMMA step waits for the slowest.
    """
    q = len(batch)
    return max(
        batch[i] * heads[j] / speeds[positions[i * q + j]] for i in range(q) for j in range(q)
    )


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(total,)]
    return [(k, *rest) for k in range(total + 1) for rest in _compositions(total - k, parts - 1)]


def place_2d(
    speeds: Sequence[float], batch: int, heads: int, *, max_evaluations: int = 2_000_000
) -> Placement2D:
    """Exhaustive best placement and shares: minimal ``block_time`` (first minimum found).

    Tries every device-to-position permutation and every split of ``batch`` over mesh rows
    and of ``heads`` over mesh columns (zeros allowed: a device may be left idle). ValueError
    when len(speeds) is not a square, a speed is not positive, or the search would take more
    than ``max_evaluations`` evaluations (small meshes only: q = 2 is 24 placements).
    """
    q = math.isqrt(len(speeds))
    if q * q != len(speeds) or not speeds:
        raise ValueError(
            f"parallel.tp: 2D tensor parallelism needs a square size, got {len(speeds)}"
        )
    if min(speeds) <= 0:
        raise ValueError(f"device speeds must be > 0, got {list(speeds)}")
    batches, head_splits = _compositions(batch, q), _compositions(heads, q)
    count = math.factorial(q * q) * len(batches) * len(head_splits)
    if count > max_evaluations:
        raise ValueError(
            f"exhaustive 2D placement would evaluate {count} cases (> {max_evaluations})"
        )
    best: Placement2D | None = None
    for positions in itertools.permutations(range(q * q)):
        for b in batches:
            for a in head_splits:
                t = block_time(speeds, positions, b, a)
                if best is None or t < best.slowest:
                    best = Placement2D(tuple(positions), b, a, t)
    assert best is not None
    return best
