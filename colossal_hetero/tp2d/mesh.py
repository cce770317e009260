"""Mesh2D: the row and column process groups of a q x q tensor-parallel group.

Built from explicit global-rank lists (the TP groups of the plugin's process-group mesh,
``dist.get_process_group_ranks(tp_group)``), never from a rank formula: the TP axis need not
be the innermost one, and a placement may put any rank at any mesh position.

``dist.new_group`` must be entered by every process of the world, in the same order, for
every group. So building is collective over the world: every rank passes the same list of
all TP groups (or ``from_tp_group`` exchanges them first) and creates, for each TP group in
that order, its q row groups (i = 0..q-1) then its q column groups (j = 0..q-1). Inside a group
torch orders ranks by global rank, not by mesh position; callers therefore address peers by
global rank (``global_rank(i, j)``), never by group-local rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal_hetero.tp2d.layout import MeshLayout, mesh_side


@dataclass(frozen=True)
class Mesh2D:
    """This rank's place in its q x q TP mesh and the two groups through it.

    ``row_group``: the q ranks of mesh row ``i`` (same batch share, all hidden widths).
    ``col_group``: the q ranks of mesh column ``j`` (same hidden width, all batch shares).
    Their intersection is this rank.
    """

    layout: MeshLayout
    i: int
    j: int
    row_group: ProcessGroup
    col_group: ProcessGroup

    @property
    def q(self) -> int:
        return self.layout.q

    def global_rank(self, i: int, j: int) -> int:
        return self.layout.global_rank(i, j)

    def row_peer(self, t: int) -> int:
        """Global rank at (i, t): the source/destination of step t on the row group."""
        return self.layout.global_rank(self.i, t)

    def col_peer(self, t: int) -> int:
        """Global rank at (t, j): the source/destination of step t on the column group."""
        return self.layout.global_rank(t, self.j)

    @classmethod
    def build(
        cls,
        tp_rank_lists: Sequence[Sequence[int]],
        placement: Mapping[int, tuple[int, int]] | None = None,
    ) -> Mesh2D:
        """Create every TP group's row and column groups; return this rank's mesh.

        Collective over the world; every rank passes the same ``tp_rank_lists`` (every TP group
        of the world, each a list of global ranks) and ``placement`` (global rank -> (i, j), for
        every rank of every TP group; default: a group's ranks row-major in the order listed).
        ValueError (the same on every rank, before any collective) when a TP group is not a
        square, the groups overlap or miss this rank, or the placement is not a bijection.
        """
        layouts = [_layout(ranks, placement) for ranks in tp_rank_lists]
        seen = [r for layout in layouts for r in layout.positions]
        if len(seen) != len(set(seen)):
            raise ValueError(f"TP groups overlap: {[list(r) for r in tp_rank_lists]}")
        me = dist.get_rank()
        mine = None
        for layout in layouts:
            groups = [dist.new_group(list(layout.row_ranks(i))) for i in range(layout.q)]
            groups += [dist.new_group(list(layout.col_ranks(j))) for j in range(layout.q)]
            if me in layout.positions:
                i, j = layout.position(me)
                mine = cls(layout, i, j, groups[i], groups[layout.q + j])
        if mine is None:
            raise ValueError(
                f"rank {me} is in none of the TP groups {list(map(list, tp_rank_lists))}"
            )
        return mine

    @classmethod
    def from_tp_group(
        cls,
        tp_group: ProcessGroup,
        placement: Mapping[int, tuple[int, int]] | PlacementOf | None = None,
    ) -> Mesh2D:
        """The mesh of ``tp_group``, learning every other TP group by one world all-gather.

        Collective over the world (``tp_rank_lists``, then ``build``). Every rank must call it
        with its own TP group, the groups partitioning the world's ranks. ``placement``: a
        mapping as ``build`` takes it, or a function of every TP group's rank list returning
        one (e.g. ``Tp2dPlan.placement_of``: the same positions by rank order in every group).
        """
        lists = tp_rank_lists(tp_group)
        if callable(placement):
            placement = placement(lists)
        return cls.build(lists, placement)


PlacementOf = Callable[[list[tuple[int, ...]]], Mapping[int, tuple[int, int]]]
"""Global rank -> mesh position, from every TP group's rank list (see ``from_tp_group``)."""


def tp_rank_lists(tp_group: ProcessGroup) -> list[tuple[int, ...]]:
    """Every TP group of the world (each its global ranks), the same list on every rank.

    Collective over the world (one all_gather_object). ValueError, before the collective, when
    the group is not a square (every rank's group has the same size).
    """
    mine = tuple(dist.get_process_group_ranks(tp_group))
    mesh_side(len(mine))
    everyone: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    lists: list[tuple[int, ...]] = []
    for ranks in everyone:
        assert ranks is not None
        if ranks not in lists:
            lists.append(ranks)
    return lists


def _layout(ranks: Sequence[int], placement: Mapping[int, tuple[int, int]] | None) -> MeshLayout:
    """Positions of one TP group: from ``placement`` when given, else row-major as listed."""
    q = mesh_side(len(ranks))
    if placement is None:
        return MeshLayout.from_ranks(ranks)
    missing = [r for r in ranks if r not in placement]
    if missing:
        raise ValueError(f"parallel.tp2d placement has no mesh position for ranks {missing}")
    by_position = {}
    for r in ranks:
        i, j = placement[r]
        if not (0 <= i < q and 0 <= j < q) or (i, j) in by_position:
            raise ValueError(
                f"parallel.tp2d placement {dict(placement)} is not a bijection onto a "
                f"{q} x {q} mesh"
            )
        by_position[i, j] = r
    return MeshLayout(tuple(by_position[divmod(p, q)] for p in range(q * q)))
