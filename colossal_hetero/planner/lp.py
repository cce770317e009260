"""The sharding-ratio LP (HAP's Eq. 3), solved with scipy's HiGHS.

Given a fixed program, every synchronising term of the step time is the maximum over its rows of
affine functions of the shares ``x`` (see :mod:`.cost`). The LP

    minimise    sum_t w_t z_t                     (z_t: epigraph of term t)
    subject to  a_{t,i} . x + c_{t,i} <= z_t      for every row i of term t
                m_d . x + k_d <= capacity_d       memory of device d
                sum_{j in S} x_j = 1, x >= 0      for every simplex S (a share vector)

keeps the constant terms ``c`` (replicated compute, all-reduces of unsplit tensors, latencies),
which HAP's code drops: they decide which device is the maximum, so dropping them misplaces
the optimum. The objective reported is the step time itself, constants included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.optimize import linprog

from colossal_hetero.planner.affine import Affine, RowVec, concat


@dataclass(frozen=True, slots=True)
class LPResult:
    """Optimal shares and the optimal objective (constant terms included)."""

    x: np.ndarray
    objective: float


def _parts(rows: RowVec, num_vars: int) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(rows, Affine):
        assert rows.num_vars == num_vars, "rows built for a different variable vector"
        return rows.const, rows.coef
    const = np.asarray(rows, dtype=float)
    return const, np.zeros((const.size, num_vars))


def minimize_max_sum(
    terms: Sequence[tuple[RowVec, float]],
    *,
    num_vars: int,
    simplices: Sequence[Sequence[int]],
    limits: Sequence[tuple[RowVec, np.ndarray]] = (),
    x0: np.ndarray | None = None,
) -> LPResult | None:
    """Minimise ``sum_t w_t * max_i rows_t[i](x)`` over shares ``x``; None if infeasible.

    Args:
        terms: ``(rows, weight)`` pairs; numeric rows are constants added to the objective.
        num_vars: length of ``x``.
        simplices: disjoint index lists; each share vector ``x[S]`` is >= 0 and sums to 1.
        limits: ``(rows, capacity)`` pairs requiring ``rows(x) <= capacity`` element-wise.
        x0: values kept for a simplex no term or limit depends on (default: uniform), so an
            unused share vector does not come back as an arbitrary vertex.
    """
    blocks, const_offset = _objective_blocks(terms, num_vars)
    # Times are ~1e-6..1e2 s and memory ~1e9 bytes: scale both to O(1) for HiGHS' tolerances.
    scale = max([float(np.abs(c).max() + np.abs(a).max()) for c, a, _ in blocks] + [1e-30])
    num_z = len(blocks)
    rows_a, rhs = [], []
    for t, (const, coef, _) in enumerate(blocks):
        z_col = np.zeros((const.size, num_z))
        z_col[:, t] = -1.0
        rows_a.append(np.hstack([coef / scale, z_col]))
        rhs.append(-const / scale)
    used = np.zeros(num_vars, dtype=bool)
    for _, coef, _ in blocks:
        used |= np.any(coef != 0, axis=0)
    for rows, capacity in limits:
        const, coef = _parts(rows, num_vars)
        cap = np.broadcast_to(np.asarray(capacity, dtype=float), const.shape)
        rows_a.append(np.hstack([coef / cap[:, None], np.zeros((const.size, num_z))]))
        rhs.append((cap - const) / cap)
        used |= np.any(coef != 0, axis=0)
    x_keep = _default_x0(num_vars, simplices) if x0 is None else np.asarray(x0, dtype=float)
    a_eq, bounds = _share_constraints(num_vars, num_z, simplices, used, x_keep)
    res = linprog(
        np.concatenate([np.zeros(num_vars), [w for _, _, w in blocks]]),
        A_ub=sparse.csr_matrix(np.vstack(rows_a)) if rows_a else None,
        b_ub=np.concatenate(rhs) if rhs else None,
        A_eq=a_eq,
        b_eq=np.ones(len(simplices)),
        bounds=bounds,
        method="highs",
    )
    if res.status == 2:
        return None
    if res.status != 0:
        raise RuntimeError(f"HiGHS failed on the sharding LP: {res.message}")
    x = np.clip(res.x[:num_vars], 0.0, None)
    for index in simplices:  # remove solver noise so each share vector sums to exactly 1
        x[list(index)] /= x[list(index)].sum()
    return LPResult(x, float(res.fun) * scale + const_offset)


def _objective_blocks(
    terms: Sequence[tuple[RowVec, float]], num_vars: int
) -> tuple[list[tuple[np.ndarray, np.ndarray, float]], float]:
    """Split the terms into ``(const, coef, weight)`` blocks that depend on ``x`` and a constant.

    A term whose rows do not depend on ``x`` contributes ``weight * max(const)`` to the offset.
    """
    const_offset = 0.0
    blocks = []
    for rows, weight in terms:
        const, coef = _parts(rows, num_vars)
        if weight == 0:
            continue
        if not coef.any():
            const_offset += weight * float(const.max())
        else:
            blocks.append((const, coef, float(weight)))
    return blocks, const_offset


def _share_constraints(
    num_vars: int,
    num_z: int,
    simplices: Sequence[Sequence[int]],
    used: np.ndarray,
    x_keep: np.ndarray,
) -> tuple[np.ndarray, list[tuple[float | None, float | None]]]:
    """Equality rows (each simplex sums to 1) and bounds; unused simplices stay at ``x_keep``."""
    bounds: list[tuple[float | None, float | None]] = [(0.0, 1.0)] * num_vars
    bounds += [(None, None)] * num_z
    a_eq = np.zeros((len(simplices), num_vars + num_z))
    for s, index in enumerate(simplices):
        a_eq[s, list(index)] = 1.0
        if not used[list(index)].any():
            for j in index:
                bounds[j] = (float(x_keep[j]), float(x_keep[j]))
    return a_eq, bounds


def _default_x0(num_vars: int, simplices: Sequence[Sequence[int]]) -> np.ndarray:
    x = np.zeros(num_vars)
    for index in simplices:
        x[list(index)] = 1.0 / len(index)
    return x


def min_overflow(
    limits: Sequence[tuple[RowVec, np.ndarray]],
    *,
    num_vars: int,
    simplices: Sequence[Sequence[int]],
) -> tuple[np.ndarray, np.ndarray]:
    """For infeasible ``limits``: shares minimising the worst relative overflow.

    Returns ``(x, usage)`` where ``usage[i] = rows(x)[i] / capacity[i]`` over all limit rows
    concatenated, so the caller can name the device that cannot fit.
    """
    terms = []
    caps = []
    for rows, capacity in limits:
        cap = np.asarray(capacity, dtype=float)
        terms.append(rows / cap)
        caps.append(cap)
    ratio = concat(terms)
    res = minimize_max_sum([(ratio, 1.0)], num_vars=num_vars, simplices=simplices)
    assert res is not None  # no limits: always feasible
    usage = ratio.value(res.x) if isinstance(ratio, Affine) else np.asarray(ratio)
    return res.x, usage
