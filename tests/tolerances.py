"""Float tolerances derived from the arithmetic, for tests that compare two computations.

Model (first-order rounding analysis, Higham, "Accuracy and Stability of Numerical
Algorithms", ch. 3-4): a sum of k terms, in any order (sequential, blocked, SIMD lanes, a ring
all-reduce), is within (k - 1) * u * sum|terms| of the exact sum, where u is the dtype's unit
roundoff. Two orders of the same sum therefore differ by at most 2 (k - 1) u sum|terms|. A
chain of D such reductions (matmuls, softmax and norm sums, all-reduces) adds their first-order
errors; layer norms and residuals keep every intermediate's magnitude comparable to the
result's, so the chain's difference is bounded by D times one reduction's, scaled by the
largest magnitude of the result. These are worst-case bounds (random rounding grows like
sqrt(k), not k): loose, but a real bug (a missing shard, a wrong scale) is off by O(1).

Adam is not covered: its update lr * m / (sqrt(v) + eps) normalises a gradient, so on an
element whose gradient is at the rounding level two runs may step by +lr and -lr. Compare
Adam trajectories like with like (tests/restart.py), or one step from the same state.
"""

from __future__ import annotations

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of rounding one result (2^-24 for float32)."""
    return torch.finfo(dtype).eps / 2


def sum_order_atol(k: int, dtype: torch.dtype, scale: float) -> float:
    """|s1 - s2| for one sum of ``k`` terms in two orders; ``scale`` >= sum|terms|.

    Each order is within (k - 1) u scale of the exact sum, so they differ by twice that.
    """
    return 2 * max(k - 1, 1) * unit_roundoff(dtype) * scale


def chain_atol(depth: int, k: int, dtype: torch.dtype, scale: float) -> float:
    """A result of ``depth`` chained reductions of at most ``k`` terms each, in two orders.

    ``scale``: the largest magnitude of the (reference) result; first-order errors add along
    the chain (see the module docstring), so depth * sum_order_atol(k, dtype, scale).
    """
    return depth * sum_order_atol(k, dtype, scale)


def transformer_depth(num_layers: int, *, backward: bool = True) -> int:
    """Chained reductions on a transformer's longest path (for :func:`chain_atol`).

    Per layer forward: Q/K/V projection, scores, softmax sum, scores x V, output projection,
    two MLP matmuls and two norm statistics (mean and variance): 9. Plus the embedding's
    norm, the LM head and the loss's log-sum-exp: 3. A gradient also runs back through all of
    them (x 2).
    """
    forward = 9 * num_layers + 3
    return 2 * forward if backward else forward


def grad_from_update_atol(lr: float, dtype: torch.dtype, weight_scale: float) -> float:
    """A gradient read back as (before - after) / lr after one SGD step.

    ``after`` is rounded once (<= u |after|) and the subtraction is exact (Sterbenz) or
    rounded once more (<= u |after|): 2 u weight_scale / lr, weight_scale >= max|weight|.
    """
    return 2 * unit_roundoff(dtype) * weight_scale / lr


FLOAT64_FORMULA_RTOL = 1e-12
"""Two float64 evaluations of one closed-form cost formula (tens of operations, each rounding
by at most u = 2^-53 ~ 1.1e-16, possibly in another order) agree to ~1e-14 relative; 1e-12
leaves room, and a wrong or missing term is off by far more."""

LP_ATOL = 1e-6
"""HiGHS (scipy's linprog) stops at primal and dual feasibility 1e-7; with coefficients of at
most ~10 in these test LPs, a solution's entries are within 1e-6 of the exact optimum."""
