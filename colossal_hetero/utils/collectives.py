"""Small agreements on tensors that live anywhere (host counts, measured seconds).

Runtime decisions agree on a few numbers built on the host. A gloo group takes them as they
are; an NCCL group takes device tensors only. These helpers run the collective on the
group's device (:func:`~colossal_hetero.utils.device.collective_device`): a tensor already
there is used in place (no copy: on gloo a host tensor is exactly a plain collective),
any other is copied there, and the result lands back on the tensor's own device. The copy is
the whole cost, so they are meant for small tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from colossal_hetero.utils.device import collective_device


def all_reduce_anywhere(
    tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None
) -> None:
    """``dist.all_reduce(tensor, op, group)`` in place, wherever ``tensor`` lives."""
    wire = tensor.to(collective_device(group))
    dist.all_reduce(wire, op=op, group=group)
    if wire is not tensor:
        tensor.copy_(wire)


def all_gather_anywhere(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every group rank's ``tensor`` (same shape and dtype everywhere), in group rank order,
    on ``tensor``'s device."""
    wire = tensor.contiguous().to(collective_device(group))
    parts = [torch.empty_like(wire) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, wire, group=group)
    return [part.to(tensor.device) for part in parts]


def broadcast_anywhere(tensor: torch.Tensor, src: int, group: Any = None) -> None:
    """``dist.broadcast(tensor, src, group)`` in place (``src`` a global rank), wherever
    ``tensor`` lives."""
    wire = tensor.to(collective_device(group))
    dist.broadcast(wire, src=src, group=group)
    if wire is not tensor:
        tensor.copy_(wire)
