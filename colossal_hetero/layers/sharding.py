"""How a parameter is split by per-rank widths, and the hooks Colossal-AI's checkpoint IO uses.

Shape letters (R ranks in the TP group, this rank r):
    widths w_0..w_{R-1} summing to W; P = ``num_parts`` (3 for a fused Q|K|V weight).
    full  [..., P * W, ...]  HF layout: part p occupies [p * W, (p + 1) * W) along ``dim``.
    local [..., P * w_r, ...] rank r's slice of every part, concatenated: [Q_r, K_r, V_r].

A sharded parameter carries Colossal-AI's customized-distributed-tensor hooks
(``shard_fn``/``gather_fn``, see colossalai.tensor.d_tensor.api) so that
``ParallelModule._save_to_state_dict`` gathers the full HF tensor and
``_load_from_state_dict`` re-shards a full tensor to the current widths; it also carries its
``shard_layout``, which resize.py reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal_hetero.comm import offsets, primitives

LAYOUT_ATTR = "shard_layout"


def shard_of(
    full: torch.Tensor, dim: int, widths: Sequence[int], rank: int, num_parts: int = 1
) -> torch.Tensor:
    """full [..., P * W, ...] -> rank's local [..., P * w_rank, ...] (a contiguous copy)."""
    total = sum(widths)
    if full.shape[dim] != num_parts * total:
        raise ValueError(
            f"tensor has {full.shape[dim]} along dim {dim}, expected {num_parts} x {total}"
        )
    start, width = offsets(widths)[rank], widths[rank]
    parts = full.split(total, dim) if total else [full] * num_parts
    return torch.cat([part.narrow(dim, start, width) for part in parts], dim).contiguous()


def merge_shards(
    shards: Sequence[torch.Tensor], dim: int, widths: Sequence[int], num_parts: int = 1
) -> torch.Tensor:
    """Every rank's local [..., P * w_r, ...] -> full [..., P * W, ...] (inverse of shard_of)."""
    split = [shard.split([w] * num_parts, dim) for shard, w in zip(shards, widths, strict=True)]
    return torch.cat([split[r][p] for p in range(num_parts) for r in range(len(widths))], dim)


@dataclass(frozen=True)
class ShardLayout:
    """A parameter split along ``dim`` by ``widths`` over ``group`` (``num_parts`` fused parts).

    Equal layouts (same dim, widths, parts and group object) shard identically, which is how
    tied weights (embedding and LM head) are recognised as already sharded.
    """

    dim: int
    widths: tuple[int, ...]
    group: ProcessGroup
    num_parts: int = 1

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """full [..., P * W, ...] -> this rank's local slice; no communication."""
        rank = dist.get_rank(self.group)
        return shard_of(full, self.dim, self.widths, rank, self.num_parts)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's local slice -> full tensor on every rank: one padded all-gather."""
        fused = [self.num_parts * w for w in self.widths]
        full = primitives.gather(local.detach(), self.dim, fused, group=self.group)
        return merge_shards(full.split(fused, self.dim), self.dim, self.widths, self.num_parts)

    def local_shape(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of this rank's slice of a full tensor of ``full_shape``."""
        shape = list(full_shape)
        shape[self.dim] = self.num_parts * self.widths[dist.get_rank(self.group)]
        return tuple(shape)


def layout_of(param: torch.Tensor) -> ShardLayout | None:
    """The layout a parameter was sharded with, or None for a replicated one."""
    return getattr(param, LAYOUT_ATTR, None)


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape of ``param`` (its own shape when it is not sharded)."""
    layout, shape = layout_of(param), list(param.shape)
    if layout is not None:
        shape[layout.dim] = layout.num_parts * sum(layout.widths)
    return tuple(shape)


def install_layout(param: torch.nn.Parameter, layout: ShardLayout) -> None:
    """Point ``param``'s checkpoint hooks and layout at ``layout`` (its data already fits)."""
    from colossalai.tensor.d_tensor.api import customized_distributed_tensor_to_existing_param

    first = not hasattr(param, "shard_fn")
    # first time: Colossal-AI also makes detach()/clone() keep the hooks
    target = param.data if first else param
    setattr(target, "shard_fn", layout.shard)  # noqa: B010 (attributes torch does not declare)
    setattr(target, "gather_fn", layout.gather)  # noqa: B010
    if first:
        customized_distributed_tensor_to_existing_param(target, param)
    setattr(param, LAYOUT_ATTR, layout)


def shard_parameter(param: torch.nn.Parameter, layout: ShardLayout) -> torch.nn.Parameter:
    """Replace ``param``'s full data by this rank's slice, in place, and install the hooks.

    A parameter already sharded with an equal layout (a tied weight seen a second time) is
    returned as is; one sharded differently is an error.
    """
    existing = layout_of(param)
    if existing is not None:
        if existing != layout:
            raise ValueError(
                f"parameter is already sharded as {existing}, cannot re-shard it as {layout}; "
                "tied weights need the same widths"
            )
        return param
    with torch.no_grad():
        param.data = layout.shard(param.data)
    install_layout(param, layout)
    return param
