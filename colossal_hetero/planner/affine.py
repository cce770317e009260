"""Rows of affine functions of the sharing variables: how one cost model feeds both A* and the LP.

The cost model is written once over "row vectors" (one row per device, or per device and
direction). Given numbers it computes times; given :class:`Affine` rows for the free shares it
computes the LP's constraint rows exactly, constant terms included. Products are only allowed
when one side is constant, which holds because each LP frees one kind of share at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class Affine:
    """``k`` rows, row ``i`` equal to ``const[i] + coef[i] @ x`` for a variable vector ``x``."""

    __slots__ = ("const", "coef")
    __array_ufunc__ = None  # numpy defers `ndarray * Affine` to Affine.__rmul__

    def __init__(self, const: np.ndarray, coef: np.ndarray) -> None:
        self.const = np.asarray(const, dtype=float)
        self.coef = np.asarray(coef, dtype=float)
        assert self.coef.ndim == 2 and self.coef.shape[0] == self.const.shape[0]

    @classmethod
    def select(
        cls, num_vars: int, index: Sequence[int] | np.ndarray, scale: float | np.ndarray = 1.0
    ) -> Affine:
        """Rows ``scale[i] * x[index[i]]``: each device's share picked out of the variables."""
        index = np.asarray(index, dtype=int)
        coef = np.zeros((index.size, num_vars))
        coef[np.arange(index.size), index] = np.broadcast_to(scale, index.shape)
        return cls(np.zeros(index.size), coef)

    @property
    def num_vars(self) -> int:
        """Length of the variable vector."""
        return self.coef.shape[1]

    def __len__(self) -> int:
        return self.const.shape[0]

    def value(self, x: np.ndarray) -> np.ndarray:
        """The rows at ``x``."""
        return self.const + self.coef @ np.asarray(x, dtype=float)

    def _lift(self, other: object) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(other, Affine):
            return other.const, other.coef
        const = np.broadcast_to(np.asarray(other, dtype=float), self.const.shape)
        return const, np.zeros_like(self.coef)

    def __add__(self, other: object) -> Affine:
        const, coef = self._lift(other)
        return Affine(self.const + const, self.coef + coef)

    __radd__ = __add__

    def __neg__(self) -> Affine:
        return Affine(-self.const, -self.coef)

    def __sub__(self, other: object) -> Affine:
        return self + (-other if isinstance(other, Affine) else -np.asarray(other, dtype=float))

    def __rsub__(self, other: object) -> Affine:
        return (-self) + other

    def __mul__(self, other: object) -> Affine:
        if isinstance(other, Affine):
            raise TypeError("product of two affine rows is not affine; fix one share first")
        factor = np.broadcast_to(np.asarray(other, dtype=float), self.const.shape)
        return Affine(self.const * factor, self.coef * factor[:, None])

    __rmul__ = __mul__

    def __truediv__(self, other: object) -> Affine:
        if isinstance(other, Affine):
            raise TypeError("division by affine rows is not affine")
        return self * (1.0 / np.asarray(other, dtype=float))

    def __rmatmul__(self, matrix: np.ndarray) -> Affine:
        return Affine(matrix @ self.const, matrix @ self.coef)


RowVec = np.ndarray | Affine
"""Numbers (a plain vector) or affine rows: what every cost-model function returns."""


def concat(parts: Sequence[RowVec]) -> RowVec:
    """Stack row vectors; the result is affine if any part is."""
    affine = [p for p in parts if isinstance(p, Affine)]
    if not affine:
        return np.concatenate([np.asarray(p, dtype=float) for p in parts])
    num_vars = affine[0].num_vars
    consts, coefs = [], []
    for p in parts:
        if isinstance(p, Affine):
            consts.append(p.const)
            coefs.append(p.coef)
        else:
            arr = np.asarray(p, dtype=float)
            consts.append(arr)
            coefs.append(np.zeros((arr.shape[0], num_vars)))
    return Affine(np.concatenate(consts), np.concatenate(coefs))


def total(parts: Sequence[RowVec]) -> RowVec:
    """Row-wise sum of equally long row vectors."""
    out: RowVec = np.zeros(len(parts[0]))
    for p in parts:
        out = p + out if isinstance(p, Affine) else out + p
    return out
