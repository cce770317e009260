"""Change a resizable layer's widths between steps without losing anything.

Every sharded tensor of the layer (weight, bias, their gradients and the optimizer state of
the same shape, e.g. Adam's exp_avg and exp_avg_sq) is gathered to its full size and re-split
to the new widths: values are moved, never recomputed, so training continues exactly as if the
widths had always been the new ones. Each tensor costs one padded all-gather over the TP group.

Parameters keep their identity (only ``.data`` changes), so optimizers and the booster's
wrappers still hold them. Tied weights are re-sharded once: a parameter already in the new
layout is skipped. Call between steps (after ``optimizer.step()``, or after ``backward`` to
move the gradients too), on every rank of the group, with the same widths.

Not supported: ZeRO (its flat fp32 master copies) and mixed-precision master weights, and
torch DDP (its buckets are sized at wrap time), i.e. data parallelism over TP groups.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from colossal_hetero.layers.linear import ResizableParallelModule
from colossal_hetero.layers.sharding import ShardLayout, install_layout, layout_of


def reshard(local: torch.Tensor, old: ShardLayout, new: ShardLayout) -> torch.Tensor:
    """This rank's slice under ``old`` -> its slice under ``new`` (gather full, re-split)."""
    return new.shard(old.gather(local))


def _optimizer_state(optimizer: Any, param: torch.Tensor) -> dict:
    """Per-parameter state of a torch optimizer or of a booster's OptimizerWrapper."""
    if optimizer is None:
        return {}
    optim = getattr(optimizer, "optim", optimizer)  # colossalai OptimizerWrapper -> torch
    return optim.state.get(param, {})


def _sharded_state_keys(state: dict, param: torch.Tensor, group: Any) -> list[str]:
    """Keys of the state tensors shaped like ``param``; every rank must have as many."""
    keys = [
        k for k, v in state.items() if torch.is_tensor(v) and v.dim() and v.shape == param.shape
    ]
    counts = torch.tensor([len(keys), -len(keys)], dtype=torch.int64, device=param.device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    if counts[0] != -counts[1]:  # one rank would wait forever in a gather the others skip
        raise RuntimeError(
            f"ranks hold different optimizer state for a sharded parameter ({sorted(keys)} "
            "here): resize before the first step or after every rank has stepped"
        )
    return sorted(keys)


@torch.no_grad()
def resize_parameter(
    param: torch.nn.Parameter, layout: ShardLayout, *, optimizer: Any = None
) -> bool:
    """Re-shard ``param``, its gradient and its optimizer state to ``layout``.

    Returns False (and does nothing) when the parameter already has that layout.
    """
    old = layout_of(param)
    if old is None:
        raise ValueError("parameter is not sharded (it has no shard_layout)")
    if old == layout:
        return False
    if old.group is not layout.group or old.dim != layout.dim or old.num_parts != layout.num_parts:
        raise ValueError(f"can only change widths: {old} -> {layout}")
    state = _optimizer_state(optimizer, param)
    keys = _sharded_state_keys(state, param, old.group)
    grad = param.grad
    param.data = reshard(param.data, old, layout)
    param.grad = None if grad is None else reshard(grad, old, layout)
    for key in keys:
        state[key] = reshard(state[key], old, layout)
    install_layout(param, layout)
    return True


def resize_layer(
    layer: ResizableParallelModule, widths: Sequence[int], *, optimizer: Any = None
) -> None:
    """Give ``layer`` new ``widths``: re-shard its parameters, gradients and optimizer state."""
    for name, layout in layer.param_layouts(widths).items():
        param = getattr(layer, name)
        if param is not None:
            resize_parameter(param, layout, optimizer=optimizer)
    layer.set_widths(widths)


def resize_layers(
    changes: Iterable[tuple[ResizableParallelModule, Sequence[int]]], *, optimizer: Any = None
) -> None:
    """``resize_layer`` for every (layer, widths) pair, in order (same order on every rank)."""
    for layer, widths in changes:
        resize_layer(layer, widths, optimizer=optimizer)
