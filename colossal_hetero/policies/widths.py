"""Per-rank widths of a model's TP dimensions, in the units a planner thinks in. Pure Python.

A ``widths`` mapping gives, per key, one count per TP rank:

- ``heads``: attention (query) heads; the unit of every attention projection.
- ``ffn``: MLP intermediate features.
- ``vocab``: vocabulary rows of the embedding and the LM head.

A key left out is split as evenly as possible (the first ranks get the remainder). Layers
get widths in features: heads x head_dim for attention projections, the counts themselves
elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def even_widths(total: int, num_ranks: int, unit: int = 1) -> tuple[int, ...]:
    """``total`` split into ``num_ranks`` near-equal multiples of ``unit`` (remainder first).

    ``total`` must be a multiple of ``unit``.
    """
    if total % unit:
        raise ValueError(f"{total} is not a multiple of {unit}")
    base, extra = divmod(total // unit, num_ranks)
    return tuple(unit * (base + (rank < extra)) for rank in range(num_ranks))


def resolve_widths(
    widths: Mapping[str, Sequence[int]],
    totals: Mapping[str, int],
    num_ranks: int,
    *,
    units: Mapping[str, int] | None = None,
    min_width: Mapping[str, int] | None = None,
) -> dict[str, tuple[int, ...]]:
    """Check ``widths`` against the model's ``totals`` and fill in missing keys evenly.

    Args:
        widths: per key, one count per rank (a subset of ``totals``' keys).
        totals: per key, the model's total (e.g. its number of heads).
        num_ranks: TP size.
        units: per key, the granularity every count must be a multiple of (default 1).
        min_width: per key, the smallest count a rank may have (default 0).

    Raises:
        ValueError: naming the key and the offending widths.
    """
    units, min_width = dict(units or {}), dict(min_width or {})
    unknown = sorted(set(widths) - set(totals))
    if unknown:
        raise ValueError(f"widths: unknown keys {unknown}; this model has {sorted(totals)}")
    resolved = {}
    for key, total in totals.items():
        unit = units.get(key, 1)
        counts = tuple(int(c) for c in widths[key]) if key in widths else None
        if counts is None:
            counts = even_widths(total, num_ranks, unit)
        _check(key, counts, total, num_ranks, unit, min_width.get(key, 0))
        resolved[key] = counts
    return resolved


def _check(
    key: str, counts: tuple[int, ...], total: int, num_ranks: int, unit: int, minimum: int
) -> None:
    if len(counts) != num_ranks:
        raise ValueError(
            f"widths[{key!r}]: {list(counts)} needs one entry per TP rank ({num_ranks})"
        )
    if sum(counts) != total:
        raise ValueError(
            f"widths[{key!r}]: {list(counts)} sums to {sum(counts)}, the model has {total}"
        )
    if any(c < minimum for c in counts):
        raise ValueError(f"widths[{key!r}]: {list(counts)}; every rank needs at least {minimum}")
    if any(c % unit for c in counts):
        raise ValueError(
            f"widths[{key!r}]: {list(counts)}; every entry must be a multiple of {unit}"
        )
