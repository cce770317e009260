"""Continuous shares to integer widths: largest remainder, in units of a granularity.

Every rank must compute the same widths, so this is pure, deterministic arithmetic: ties go to
the lower device index and no floating-point sum decides more than one unit at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_EPS = 1e-9


def _normalized(ratios: Sequence[float]) -> np.ndarray:
    r = np.asarray(ratios, dtype=float)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"ratios must be a non-empty vector, got {ratios!r}")
    if not np.all(np.isfinite(r)) or np.any(r < -_EPS):
        raise ValueError(f"ratios must be finite and >= 0, got {list(r)}")
    r = np.clip(r, 0.0, None)
    if r.sum() <= 0:
        raise ValueError("ratios must not all be zero")
    return r / r.sum()


def _water_fill(r: np.ndarray, units: int, cap: np.ndarray) -> np.ndarray:
    """Real allocation summing to ``units``, proportional to ``r`` except where capped."""
    alloc = np.zeros(r.size)
    free = np.ones(r.size, dtype=bool)
    while free.any():
        weights = r[free] if r[free].sum() > 0 else np.ones(int(free.sum()))
        share = (units - alloc[~free].sum()) * weights / weights.sum()
        over = share > cap[free] + _EPS
        if not over.any():
            alloc[free] = share
            break
        capped = np.flatnonzero(free)[over]
        alloc[capped] = cap[capped]
        free[capped] = False
    return alloc


def round_widths(
    dim: int,
    ratios: Sequence[float],
    *,
    granularity: int = 1,
    caps: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """Split ``dim`` into one integer width per device, in proportion to ``ratios``.

    Contract:
        * ``sum(widths) == dim``; zero widths are allowed (a zero ratio gives zero).
        * Every width is a multiple of ``granularity``, except that the ``dim % granularity``
          leftover elements go to the device with the largest ratio (lowest index on ties).
        * ``widths[d] <= caps[d]``; capped devices' excess goes to the others in proportion.
        * Where no cap binds, ``|widths[d] - ratio[d] * dim| < granularity + dim % granularity``
          (``< granularity`` when it divides ``dim``), ratios normalised to sum to 1.
        * Deterministic: ties break toward the lower device index.

    Raises:
        ValueError: ratios negative, non-finite or all zero; caps too small to hold ``dim``.
    """
    if dim < 0 or granularity < 1:
        raise ValueError(f"need dim >= 0 and granularity >= 1, got {dim} and {granularity}")
    r = _normalized(ratios)
    n = r.size
    units, leftover = divmod(dim, granularity)
    if caps is None:
        cap_units = np.full(n, np.inf)
        cap_elems = np.full(n, np.inf)
    else:
        cap_elems = np.asarray(caps, dtype=float)
        if cap_elems.shape != (n,) or np.any(cap_elems < 0):
            raise ValueError(f"caps must be {n} values >= 0, got {caps!r}")
        cap_units = np.floor(cap_elems / granularity)
    if cap_units.sum() < units:
        raise ValueError(
            f"caps hold {int(cap_units.sum()) * granularity} elements in multiples of "
            f"{granularity}, fewer than the {dim} to split"
        )
    alloc = _water_fill(r, units, cap_units)
    base = np.minimum(np.floor(alloc + _EPS), cap_units)
    order = sorted(range(n), key=lambda d: (-(alloc[d] - base[d]), d))
    left = units - int(base.sum())
    while left > 0:  # largest remainders first; one unit each
        progressed = False
        for d in order:
            if left and base[d] < cap_units[d]:
                base[d] += 1
                left -= 1
                progressed = True
        assert progressed, "caps were checked to hold every unit"
    for d in reversed(order):  # float noise can floor one unit too many: take it back
        if left < 0 and base[d] > 0:
            base[d] -= 1
            left += 1
    widths = base.astype(int) * granularity
    if leftover:
        takers = sorted(range(n), key=lambda d: (-r[d], d))
        taker = next((d for d in takers if widths[d] + leftover <= cap_elems[d]), None)
        if taker is None:
            raise ValueError(f"no device has room for the {leftover} leftover elements of {dim}")
        widths[taker] += leftover
    return tuple(int(w) for w in widths)
