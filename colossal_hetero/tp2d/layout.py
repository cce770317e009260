"""Pure layout math of a q x q tensor-parallel mesh (no torch.distributed).

Mesh position (i, j): mesh row i, mesh column j, both in 0..q-1, numbered row-major
(position p = i * q + j). ``positions[p]`` is the global rank sitting at position p: any
permutation of the TP group's global ranks, so neither the TP axis's place in the global rank
order nor the order inside the TP group is assumed.

Block sizes: a dense dimension of size D split over the q mesh rows (or columns) is a list of
q non-negative sizes summing to D. Activations [B, ..., H] are split by batch over mesh rows
(``batch_sizes``, one batch share per row) and by hidden over mesh columns (``hidden_sizes``,
one width per column); rank (i, j) holds the block [b_i, ..., h_j]. Uneven sizes are what
make the mesh resizable: a row of slow devices gets a smaller batch share, a column a narrower
width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def mesh_side(tp_size: int, *, field: str = "parallel.tp") -> int:
    """q with q * q == tp_size; ValueError naming ``field`` when tp_size is not a square."""
    q = math.isqrt(tp_size) if tp_size > 0 else 0
    if tp_size <= 0 or q * q != tp_size:
        raise ValueError(f"{field}: 2D tensor parallelism needs a square size, got {tp_size}")
    return q


def even_sizes(total: int, parts: int) -> tuple[int, ...]:
    """``total`` split into ``parts`` sizes differing by at most one, larger ones first."""
    if parts <= 0 or total < 0:
        raise ValueError(f"cannot split {total} into {parts} parts")
    base, extra = divmod(total, parts)
    return tuple(base + (1 if k < extra else 0) for k in range(parts))


def offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    """Start of every block: (0, s_0, s_0 + s_1, ...)."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return tuple(starts)


def check_sizes(
    sizes: Sequence[int], q: int, *, name: str, total: int | None = None
) -> tuple[int, ...]:
    """``sizes`` as q non-negative ints (summing to ``total`` when given); else ValueError."""
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != q:
        raise ValueError(f"{name}: need one size per mesh row/column ({q}), got {list(sizes)}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"{name}: sizes must be >= 0, got {list(sizes)}")
    if total is not None and sum(sizes) != total:
        raise ValueError(f"{name}: sizes {list(sizes)} sum to {sum(sizes)}, expected {total}")
    return sizes


def head_widths(head_counts: Sequence[int], head_dim: int) -> tuple[int, ...]:
    """Hidden width of every mesh column when column j holds ``head_counts[j]`` whole heads."""
    return tuple(int(a) * head_dim for a in head_counts)


@dataclass(frozen=True)
class MeshLayout:
    """Which global rank sits at which mesh position; the row and column rank lists.

    ``positions``: global rank at position i * q + j, for every position (a permutation of the
    TP group's ranks).
    """

    positions: tuple[int, ...]

    def __post_init__(self) -> None:
        mesh_side(len(self.positions))
        if len(set(self.positions)) != len(self.positions):
            raise ValueError(f"mesh positions repeat a rank: {list(self.positions)}")

    @classmethod
    def from_ranks(
        cls, tp_ranks: Sequence[int], position_map: Sequence[int] | None = None
    ) -> MeshLayout:
        """Layout of the TP group ``tp_ranks`` (its global ranks).

        ``position_map``: the global rank to place at each position (row-major); it must be a
        permutation of ``tp_ranks``. Default: the ranks in the order given.
        """
        ranks = tuple(int(r) for r in tp_ranks)
        mesh_side(len(ranks))
        if position_map is None:
            return cls(ranks)
        placed = tuple(int(r) for r in position_map)
        if sorted(placed) != sorted(ranks):
            raise ValueError(
                f"parallel.tp2d position map {list(placed)} is not a permutation of the TP "
                f"group's ranks {list(ranks)}"
            )
        return cls(placed)

    @property
    def q(self) -> int:
        return math.isqrt(len(self.positions))

    def global_rank(self, i: int, j: int) -> int:
        """The global rank at mesh position (i, j)."""
        q = self.q
        if not (0 <= i < q and 0 <= j < q):
            raise IndexError(f"mesh position ({i}, {j}) outside a {q} x {q} mesh")
        return self.positions[i * q + j]

    def position(self, rank: int) -> tuple[int, int]:
        """(i, j) of a global rank of this mesh."""
        p = self.positions.index(rank)
        return divmod(p, self.q)

    def row_ranks(self, i: int) -> tuple[int, ...]:
        """Global ranks of mesh row i, in column order j = 0..q-1."""
        return tuple(self.global_rank(i, j) for j in range(self.q))

    def col_ranks(self, j: int) -> tuple[int, ...]:
        """Global ranks of mesh column j, in row order i = 0..q-1."""
        return tuple(self.global_rank(i, j) for i in range(self.q))


def block_shape_2d(
    batch_sizes: Sequence[int],
    hidden_sizes: Sequence[int],
    i: int,
    j: int,
    middle: Sequence[int] = (),
) -> tuple[int, ...]:
    """Shape of rank (i, j)'s activation block: [b_i, *middle, h_j]."""
    return (int(batch_sizes[i]), *(int(m) for m in middle), int(hidden_sizes[j]))
