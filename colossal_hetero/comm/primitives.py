"""Collectives over uneven shards, without autograd: the building blocks of ``functional``.

Shape letters (R ranks in ``group``, this rank r):
    widths  w_0..w_{R-1}, one per rank, summing to W; any may be 0.
    x_local [..., w_r, ...]   the shard along ``dim``
    x_full  [..., W, ...]     the shards concatenated along ``dim`` in rank order

Every rank passes the same ``widths`` (and the same sizes in every other dim); the functions
check the local shapes only. Two methods:

- ``"padded"``: pad each shard to max(w), run one even collective (all_gather_into_tensor,
  reduce_scatter_tensor, all_to_all_single), slice the padding off. One call; wastes
  (R * max(w) - W) / W of the bytes.
- ``"grouped"``: one broadcast (gather) or reduce (reduce-scatter) per non-empty shard, or
  all_to_all_single with per-rank splits (all-to-all). No padding; R calls.

Both run on gloo (which lacks list-form uneven all_gather) and on NCCL. Ranks with zero-width
shards take part in every collective; a collective whose every shard is empty is skipped on
all ranks alike, because every rank sees the same widths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

Method = Literal["padded", "grouped"]
METHODS: tuple[Method, ...] = ("padded", "grouped")


def check_widths(widths: Sequence[int], group: ProcessGroup) -> tuple[int, ...]:
    """``widths`` as a tuple of non-negative ints, one per rank of ``group``; else ValueError."""
    if group is None:
        raise ValueError("group is required (None would silently mean the world group)")
    widths = tuple(int(w) for w in widths)
    size = dist.get_world_size(group)
    if len(widths) != size:
        raise ValueError(f"need one width per rank of the group ({size}), got {list(widths)}")
    if any(w < 0 for w in widths):
        raise ValueError(f"widths must be >= 0, got {list(widths)}")
    return widths


def check_method(method: str) -> None:
    """ValueError unless ``method`` is "padded" or "grouped"."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def offsets(widths: Sequence[int]) -> list[int]:
    """Start of every rank's shard in the full tensor: [0, w_0, w_0 + w_1, ...]."""
    starts, total = [], 0
    for width in widths:
        starts.append(total)
        total += width
    return starts


def _rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with ``dim`` moved to the front, contiguous: collectives split along dim 0."""
    return x.movedim(dim, 0).contiguous()


def _unrows(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.movedim(0, dim).contiguous()


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    padded = x.new_zeros((rows, *x.shape[1:]))
    padded[: x.shape[0]] = x
    return padded


def gather(
    x_local: torch.Tensor,
    dim: int,
    widths: Sequence[int],
    *,
    group: ProcessGroup,
    method: Method = "padded",
) -> torch.Tensor:
    """x_local [..., w_r, ...] -> x_full [..., W, ...] on every rank of ``group``.

    padded: all_gather_into_tensor of [max(w), ...]; grouped: one broadcast per shard.
    """
    check_method(method)
    widths = check_widths(widths, group)
    dim = dim % x_local.dim()
    rank = dist.get_rank(group)
    if x_local.shape[dim] != widths[rank]:
        raise ValueError(
            f"local shard has {x_local.shape[dim]} along dim {dim}, widths say {widths[rank]}"
        )
    rows = _rows(x_local, dim)
    rest = tuple(rows.shape[1:])
    if max(widths) == 0 or math.prod(rest) == 0:
        return _unrows(rows.new_zeros((sum(widths), *rest)), dim)
    if method == "padded":
        width = max(widths)
        out = rows.new_empty((len(widths) * width, *rest))
        dist.all_gather_into_tensor(out, _pad_rows(rows, width), group=group)
        pieces = [out[i * width : i * width + w] for i, w in enumerate(widths)]
    else:
        pieces, works = [], []
        for src, w in enumerate(widths):
            piece = rows if src == rank else rows.new_empty((w, *rest))
            if w > 0:
                root = dist.get_global_rank(group, src)
                works.append(dist.broadcast(piece, src=root, group=group, async_op=True))
            pieces.append(piece)
        for work in works:
            work.wait()
    return _unrows(torch.cat(pieces, 0), dim)


def reduce_scatter(
    x_full: torch.Tensor,
    dim: int,
    widths: Sequence[int],
    *,
    group: ProcessGroup,
    method: Method = "padded",
) -> torch.Tensor:
    """x_full [..., W, ...] on every rank -> (sum over ranks)[..., own w_r slice, ...].

    padded: reduce_scatter_tensor of R blocks of [max(w), ...]; grouped: one reduce per shard.
    """
    check_method(method)
    widths = check_widths(widths, group)
    dim = dim % x_full.dim()
    if x_full.shape[dim] != sum(widths):
        raise ValueError(
            f"full tensor has {x_full.shape[dim]} along dim {dim}, widths sum to {sum(widths)}"
        )
    rank = dist.get_rank(group)
    rows = _rows(x_full, dim)
    rest = tuple(rows.shape[1:])
    if max(widths) == 0 or math.prod(rest) == 0:
        return _unrows(rows.new_zeros((widths[rank], *rest)), dim)
    pieces = rows.split(list(widths), 0)
    if method == "padded":
        width = max(widths)
        send = torch.cat([_pad_rows(piece, width) for piece in pieces], 0)
        out = rows.new_empty((width, *rest))
        dist.reduce_scatter_tensor(out, send, group=group)
        return _unrows(out[: widths[rank]], dim)
    # reduce may use its input as scratch on every rank: reduce copies, keep our own result.
    buffers = [piece.clone() for piece in pieces]
    works = [
        dist.reduce(buf, dst=dist.get_global_rank(group, dst), group=group, async_op=True)
        for dst, buf in enumerate(buffers)
        if widths[dst] > 0
    ]
    for work in works:
        work.wait()
    return _unrows(buffers[rank], dim)


def all_to_all(
    x: torch.Tensor,
    *,
    split_dim: int,
    cat_dim: int,
    split_widths: Sequence[int],
    cat_widths: Sequence[int],
    group: ProcessGroup,
    method: Method = "padded",
) -> torch.Tensor:
    """Re-shard from ``cat_dim`` to ``split_dim``.

    x [.. S = sum(split_widths) at split_dim .., c_r at cat_dim ..] ->
    y [.. s_r at split_dim .., C = sum(cat_widths) at cat_dim ..]. Rank r sends its
    ``split_widths[d]`` slice of split_dim to rank d; received chunks are concatenated along
    cat_dim in rank order. Chunks travel flattened, so they need not be contiguous rows.

    padded: all_to_all_single with every chunk padded to the largest; grouped:
    all_to_all_single with per-rank element splits.
    """
    check_method(method)
    split_widths, cat_widths = check_widths(split_widths, group), check_widths(cat_widths, group)
    split_dim, cat_dim = split_dim % x.dim(), cat_dim % x.dim()
    if split_dim == cat_dim:
        raise ValueError(f"split_dim and cat_dim must differ, both are {split_dim}")
    rank = dist.get_rank(group)
    if x.shape[split_dim] != sum(split_widths) or x.shape[cat_dim] != cat_widths[rank]:
        raise ValueError(
            f"input shape {tuple(x.shape)} does not fit split_widths {list(split_widths)} at dim "
            f"{split_dim} and cat width {cat_widths[rank]} at dim {cat_dim}"
        )
    # Elements per unit of split width times cat width: the same on every rank.
    other = math.prod(s for i, s in enumerate(x.shape) if i not in (split_dim, cat_dim))
    chunks = [c.contiguous().view(-1) for c in x.split(list(split_widths), split_dim)]
    recv_sizes = [other * split_widths[rank] * c for c in cat_widths]
    block = other * max(split_widths) * max(cat_widths)
    if block == 0:
        received = [x.new_empty(n) for n in recv_sizes]
    elif method == "grouped":
        out = x.new_empty(sum(recv_sizes))
        send_sizes = [c.numel() for c in chunks]
        dist.all_to_all_single(out, torch.cat(chunks), recv_sizes, send_sizes, group=group)
        received = list(out.split(recv_sizes))
    else:
        out = x.new_empty(block * len(chunks))
        dist.all_to_all_single(out, torch.cat([_pad_rows(c, block) for c in chunks]), group=group)
        received = [out[i * block : i * block + n] for i, n in enumerate(recv_sizes)]
    out_shape = list(x.shape)
    out_shape[split_dim] = split_widths[rank]
    parts = []
    for src, flat in enumerate(received):
        out_shape[cat_dim] = cat_widths[src]
        parts.append(flat.view(out_shape))
    return torch.cat(parts, cat_dim)
