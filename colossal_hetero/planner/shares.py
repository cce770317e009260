"""Shares for a fixed program: the LP step of HAP's loop, and rounding to integer loads.

Three share vectors exist (see :class:`.cost.Shares`): tensor-parallel ratios and in-group batch
ratios (one entry per tensor-parallel rank, shared by every group, because a sharded weight's
gradient ring pairs equal shards), and group batch ratios. Device (g, k) computes in proportion
to ``groups[g] * tp[k]``, which is bilinear, so the LP step solves two LPs in turn: ranks with
groups fixed, then groups with ranks fixed. Each is exact for the cost model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from colossal_hetero.planner.affine import RowVec, total
from colossal_hetero.planner.cost import Loads, Shares
from colossal_hetero.planner.lp import LPResult, min_overflow, minimize_max_sum
from colossal_hetero.planner.rounding import round_widths
from colossal_hetero.planner.search import Choice, Problem, Program, State
from colossal_hetero.planner.spec import ClusterSpec, Mesh, ModelSpec, ShardDim


def initial_shares(cluster: ClusterSpec, mesh: Mesh) -> Shares:
    """HAP's start: shares proportional to compute speed (per rank, per group)."""
    speeds = np.asarray(cluster.speeds).reshape(mesh.dp_size, mesh.tp_size)
    tp = speeds.sum(axis=0) / speeds.sum()
    groups = speeds.sum(axis=1) / speeds.sum()
    return Shares(tuple(tp), tuple(tp), tuple(groups))


def uniform_shares(mesh: Mesh) -> Shares:
    """The even split stock frameworks use."""
    tp = (1.0 / mesh.tp_size,) * mesh.tp_size
    return Shares(tp, tp, (1.0 / mesh.dp_size,) * mesh.dp_size)


def program_rows(
    problem: Problem, program: Program, loads: Loads
) -> tuple[list[tuple[RowVec, float]], RowVec]:
    """The program's terms as ``(rows, multiplicity)`` and its per-device memory rows.

    Identical edges (same layer signature, state and choice) are built once and weighted by
    how often they occur, which keeps the LP small for deep models.
    """
    edges: Counter[tuple[int, State, Choice]] = Counter()
    first: dict[tuple[int, State, Choice], int] = {}
    for i, (state, choice) in enumerate(zip(program.states, program.choices, strict=True)):
        key = (problem.edge_class[i], state, choice)
        edges[key] += 1
        first.setdefault(key, i)
    terms: list[tuple[RowVec, float]] = []
    memory: list[RowVec] = []
    for key, count in edges.items():
        i, state, choice = first[key], key[1], key[2]
        step = problem.edge_terms(i, state, choice, loads)
        assert step is not None, "program was replayed as valid"
        terms += [(t.rows, float(count)) for t in step[0]]
        memory.append(problem.cost.memory(problem.layers[i], choice.strategy, loads) * count)
    return terms, total(memory)


def program_memory(problem: Problem, program: Program, loads: Loads) -> np.ndarray:
    """Bytes per device of ``program`` at numeric ``loads``."""
    return np.asarray(program_rows(problem, program, loads)[1], dtype=float)


def _solve(
    problem: Problem, program: Program, loads: Loads, num_vars: int, simplices, x0: np.ndarray
) -> LPResult | None:
    terms, memory = program_rows(problem, program, loads)
    capacity = np.asarray(problem.cost.cluster.memory_bytes)
    return minimize_max_sum(
        terms, num_vars=num_vars, simplices=simplices, limits=[(memory, capacity)], x0=x0
    )


def optimize_shares(problem: Problem, program: Program, shares: Shares) -> Shares | None:
    """Shares minimising the program's step time within memory; None if nothing fits."""
    mesh, batch = problem.cost.mesh, problem.cost.model.batch_size
    tp = mesh.tp_size
    if tp > 1:
        loads = Loads.free_tp(mesh, batch, shares)
        x0 = np.concatenate([shares.tp, shares.batch])
        res = _solve(problem, program, loads, 2 * tp, [range(tp), range(tp, 2 * tp)], x0)
        if res is None:
            return None
        shares = Shares(tuple(res.x[:tp]), tuple(res.x[tp:]), shares.groups)
    if mesh.dp_size > 1:
        loads = Loads.free_groups(mesh, batch, shares)
        x0 = np.asarray(shares.groups)
        res = _solve(problem, program, loads, mesh.dp_size, [range(mesh.dp_size)], x0)
        if res is None:
            return None
        shares = Shares(shares.tp, shares.batch, tuple(res.x))
    used = program_memory(problem, program, Loads.continuous(mesh, batch, shares))
    if np.any(used > np.asarray(problem.cost.cluster.memory_bytes) * (1 + 1e-9)):
        return None  # only reachable without free shares (one device) or by solver noise
    return shares


def memory_error(problem: Problem, program: Program, shares: Shares) -> ValueError:
    """A ValueError naming the device that cannot fit, at the least-overflowing shares."""
    mesh, batch = problem.cost.mesh, problem.cost.model.batch_size
    capacity = np.asarray(problem.cost.cluster.memory_bytes)
    if mesh.tp_size > 1:
        loads = Loads.free_tp(mesh, batch, shares)
        _, memory = program_rows(problem, program, loads)
        tp = mesh.tp_size
        x, usage = min_overflow(
            [(memory, capacity)], num_vars=2 * tp, simplices=[range(tp), range(tp, 2 * tp)]
        )
        shares = Shares(tuple(x[:tp]), tuple(x[tp:]), shares.groups)
    used = program_memory(problem, program, Loads.continuous(mesh, batch, shares))
    d = int(np.argmax(used / capacity))
    return ValueError(
        f"device {d}: needs {used[d]:.4g} bytes ({used[d] / 2**30:.2f} GiB) for its share of "
        f"weights, gradients, optimizer states and activations, but has {capacity[d]:.4g} "
        f"bytes ({capacity[d] / 2**30:.2f} GiB); no split of the model fits"
    )


@dataclass(frozen=True, slots=True)
class IntegerShares:
    """Shares rounded for execution: what every rank must agree on."""

    widths: dict[ShardDim, tuple[int, ...]]
    """Per split dimension, the width of each tensor-parallel rank."""
    group_samples: tuple[int, ...]
    """Samples of the global batch per data-parallel group."""
    batch_split: tuple[tuple[int, ...], ...]
    """Per group, samples per tensor-parallel rank under the data strategy."""

    def loads(self, mesh: Mesh) -> Loads:
        """Numeric loads of these shares."""
        return Loads.rounded(mesh, self.widths, self.group_samples, self.batch_split)


def shard_dims(model: ModelSpec) -> list[ShardDim]:
    """Every split dimension of the model, in first-use order."""
    dims: dict[ShardDim, None] = {}
    for layer in model.layers:
        for dim in (layer.in_shard, layer.out_shard):
            if dim is not None:
                dims.setdefault(dim)
    return list(dims)


def round_shares(
    model: ModelSpec,
    mesh: Mesh,
    shares: Shares,
    *,
    floor_ranks: frozenset[int] = frozenset(),
    floor_groups: frozenset[int] = frozenset(),
) -> IntegerShares:
    """Round every share vector; ``floor_*`` devices round down (a memory-tight device must
    not gain the unit that rounding up would give it)."""

    def caps(
        ratios: tuple[float, ...], size: int, floored: frozenset[int], least: int = 0
    ) -> list[int] | None:
        if not floored:
            return None
        return [
            max(int(np.floor(r * size + 1e-9)), least) if i in floored else size
            for i, r in enumerate(ratios)
        ]

    widths = {
        dim: round_widths(
            dim.size,
            shares.tp,
            granularity=dim.granularity,
            caps=caps(shares.tp, dim.size, floor_ranks, dim.min_units * dim.granularity),
            min_units=dim.min_units,  # what the layers need (a head group per rank)
        )
        for dim in shard_dims(model)
    }
    samples = round_widths(
        model.batch_size, shares.groups, caps=caps(shares.groups, model.batch_size, floor_groups)
    )
    split = tuple(
        round_widths(s, shares.batch, caps=caps(shares.batch, s, floor_ranks)) for s in samples
    )
    return IntegerShares(widths, samples, split)
