"""Collectives tolerant of uneven shards (per-rank ``widths``), with and without autograd.

``functional`` holds the differentiable conjugate pairs the layers use; ``primitives`` the
plain collectives (checkpoint gathers, re-sharding). Both take ``group`` as a required keyword.
"""

from colossal_hetero.comm.functional import (
    all_gather_uneven,
    all_reduce,
    all_to_all_uneven,
    copy_to_group,
    own_slice,
    reduce_scatter_uneven,
    split_uneven,
)
from colossal_hetero.comm.primitives import METHODS, Method, check_widths, offsets

__all__ = [
    "METHODS",
    "Method",
    "all_gather_uneven",
    "all_reduce",
    "all_to_all_uneven",
    "check_widths",
    "copy_to_group",
    "offsets",
    "own_slice",
    "reduce_scatter_uneven",
    "split_uneven",
]
