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


def _water_fill(r: np.ndarray, units: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Real allocation summing to ``units``, proportional to ``r`` except where a bound binds.

    Devices whose proportional share falls below ``lo`` are fixed there first (raising the
    others' share never lowers theirs), then devices above ``hi`` are fixed at ``hi``; the
    rest share what is left. Needs ``sum(lo) <= units <= sum(hi)`` and ``lo <= hi``.
    """
    alloc = np.zeros(r.size)
    free = np.ones(r.size, dtype=bool)
    while free.any():
        weights = r[free] if r[free].sum() > 0 else np.ones(int(free.sum()))
        share = (units - alloc[~free].sum()) * weights / weights.sum()
        under = share < lo[free] - _EPS
        over = share > hi[free] + _EPS
        if not under.any() and not over.any():
            alloc[free] = share
            break
        bound, violated = (lo, under) if under.any() else (hi, over)
        fixed = np.flatnonzero(free)[violated]
        alloc[fixed] = bound[fixed]
        free[fixed] = False
    return alloc


def round_widths(
    dim: int,
    ratios: Sequence[float],
    *,
    granularity: int = 1,
    caps: Sequence[int] | None = None,
    min_units: int = 0,
) -> tuple[int, ...]:
    """Split ``dim`` into one integer width per device, in proportion to ``ratios``.

    Contract:
        * ``sum(widths) == dim``.
        * Every width is a multiple of ``granularity``, except that the ``dim % granularity``
          leftover elements go to the device with the largest ratio (lowest index on ties).
        * ``widths[d] >= min_units * granularity`` for every device (a zero ratio gets exactly
          that); zero widths are allowed only when ``min_units`` is 0.
        * ``widths[d] <= caps[d]``; capped devices' excess goes to the others in proportion.
        * Where no bound binds, ``|widths[d] - ratio[d] * dim| < granularity + dim % granularity``
          (``< granularity`` when it divides ``dim``), ratios normalised to sum to 1.
        * Deterministic: ties break toward the lower device index.

    Raises:
        ValueError: ratios negative, non-finite or all zero; caps too small to hold ``dim``
            or below the minimum; fewer than ``min_units`` granules per device in ``dim``.
    """
    if dim < 0 or granularity < 1 or min_units < 0:
        raise ValueError(
            f"need dim >= 0, granularity >= 1 and min_units >= 0, got {dim}, {granularity} "
            f"and {min_units}"
        )
    r = _normalized(ratios)
    n = r.size
    units, leftover = divmod(dim, granularity)
    lo = np.full(n, float(min_units))
    if lo.sum() > units:
        raise ValueError(
            f"{dim} elements hold {units} units of {granularity}, fewer than {min_units} "
            f"for each of {n} devices"
        )
    cap_units, cap_elems = _caps_in_units(caps, n, granularity, dim, lo, min_units)
    base = _integer_units(r, units, lo, cap_units)
    widths = base * granularity
    if leftover:
        takers = sorted(range(n), key=lambda d: (-r[d], d))
        taker = next((d for d in takers if widths[d] + leftover <= cap_elems[d]), None)
        if taker is None:
            raise ValueError(f"no device has room for the {leftover} leftover elements of {dim}")
        widths[taker] += leftover
    return tuple(int(w) for w in widths)


def _caps_in_units(
    caps: Sequence[int] | None,
    n: int,
    granularity: int,
    dim: int,
    lo: np.ndarray,
    min_units: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-device caps in granules and in elements (inf without caps); checks they fit."""
    if caps is None:
        return np.full(n, np.inf), np.full(n, np.inf)
    cap_elems = np.asarray(caps, dtype=float)
    if cap_elems.shape != (n,) or np.any(cap_elems < 0):
        raise ValueError(f"caps must be {n} values >= 0, got {caps!r}")
    cap_units = np.floor(cap_elems / granularity)
    if cap_units.sum() < dim // granularity:
        raise ValueError(
            f"caps hold {int(cap_units.sum()) * granularity} elements in multiples of "
            f"{granularity}, fewer than the {dim} to split"
        )
    if np.any(cap_units < lo):
        d = int(np.flatnonzero(cap_units < lo)[0])
        raise ValueError(
            f"device {d}: its cap of {int(cap_elems[d])} is below the minimum of "
            f"{min_units * granularity}"
        )
    return cap_units, cap_elems


def _integer_units(r: np.ndarray, units: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Whole units per device within ``[lo, hi]``, summing to ``units``: the water-filled
    allocation floored, then the largest remainders rounded up."""
    n = r.size
    alloc = _water_fill(r, units, lo, hi)
    base = np.clip(np.floor(alloc + _EPS), lo, hi)
    order = sorted(range(n), key=lambda d: (-(alloc[d] - base[d]), d))
    left = units - int(base.sum())
    while left > 0:  # largest remainders first; one unit each
        progressed = False
        for d in order:
            if left and base[d] < hi[d]:
                base[d] += 1
                left -= 1
                progressed = True
        assert progressed, "caps were checked to hold every unit"
    for d in reversed(order):  # float noise can floor one unit too many: take it back
        if left < 0 and base[d] > lo[d]:
            base[d] -= 1
            left += 1
    assert left == 0, "the minimum was checked to fit"
    return base.astype(int)
