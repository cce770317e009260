"""Change a resizable layer's widths between steps without losing anything.

Every sharded tensor of the layer (weight, bias, their gradients and the optimizer state of
the same shape, e.g. Adam's exp_avg and exp_avg_sq) is gathered to its full size and re-split
to the new widths: values are moved, never recomputed, so training continues exactly as if the
widths had always been the new ones. Each tensor costs one padded all-gather over the TP group.

Under Colossal-AI's mixed precision (``MixedPrecisionOptimizer``: fp16/bf16 working
parameters, fp32 master copies that the optimizer steps) the master copy, its gradient and its
state move as well, each in its own dtype: the fp32 values are moved, never re-derived from
the low-precision working parameter.

Parameters and master copies keep their identity (only ``.data`` changes), so optimizers, the
working<->master maps and the booster's wrappers still hold them. Tied weights are re-sharded
once: a parameter already in the new layout is skipped. Call between steps (after
``optimizer.step()``, or after ``backward`` to move the gradients too), on every rank of the
group, with the same widths.

Not supported here: ZeRO (its flat fp32 partitions), and torch DDP, whose reducer pins every
parameter's gradient shape: plugin/resizing.py rebuilds it after the move.
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


def _stepped(optimizer: Any, param: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The tensor the optimizer steps for ``param`` and its per-parameter state.

    That tensor is ``param`` itself, or its fp32 master copy under Colossal-AI's mixed
    precision (``working_to_master_map``). Accepts a torch optimizer or a booster wrapper.
    """
    if optimizer is None:
        return param, {}
    master = getattr(optimizer, "working_to_master_map", {}).get(param, param)
    optim = getattr(optimizer, "optim", optimizer)  # colossalai OptimizerWrapper -> torch
    return master, optim.state.get(master, {})


def _agreed_state_keys(
    state: dict, param: torch.Tensor, master: torch.Tensor, group: Any
) -> list[str]:
    """Keys of the state tensors shaped like ``master``; every rank must move as many tensors.

    One all-reduce of three integers over ``group``: the number of state tensors, and whether
    ``param`` and ``master`` hold gradients, must agree (else a rank would wait forever in a
    gather the others skip).
    """
    keys = sorted(
        k for k, v in state.items() if torch.is_tensor(v) and v.dim() and v.shape == master.shape
    )
    has_master_grad = master is not param and master.grad is not None
    moving = [len(keys), int(param.grad is not None), int(has_master_grad)]
    counts = torch.tensor(moving + [-n for n in moving], dtype=torch.int64, device=param.device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(counts[:3], -counts[3:]):
        raise RuntimeError(
            f"ranks hold different gradients or optimizer state for a sharded parameter "
            f"({sorted(keys)} here): resize before the first step or after every rank has "
            "stepped, with the same optimizer on every rank"
        )
    return keys


def _reshard_grad(
    grad: torch.Tensor | None, old: ShardLayout, new: ShardLayout
) -> torch.Tensor | None:
    return None if grad is None else reshard(grad, old, new)


def _forget_grad_accumulator(param: torch.Tensor) -> None:
    """Drop ``param``'s cached gradient accumulator (autograd's AccumulateGrad node).

    A graph still alive from the last step (a training loop's ``loss`` variable holds it
    until the next forward) keeps that node, with the old shape as its input metadata, and
    autograd hands the same node to the next backward, which then rejects the resized
    gradient. Assigning ``.data`` resets the cached node only when the dtype or device
    changes, so the data is swapped to another dtype and back.
    """
    data = param.data
    other = torch.float32 if data.dtype == torch.float64 else torch.float64
    param.data = torch.empty(0, dtype=other, device=data.device)
    param.data = data


@torch.no_grad()
def resize_parameter(
    param: torch.nn.Parameter, layout: ShardLayout, *, optimizer: Any = None
) -> bool:
    """Re-shard ``param``, its gradient, its master copy and optimizer state to ``layout``.

    Collectives, all over the layout's group, in the same order on every rank: one small
    all-reduce (agreement on what moves), then one padded all-gather per moving tensor.
    Returns False (and does nothing, no collective) when ``param`` already has that layout.
    """
    old = layout_of(param)
    if old is None:
        raise ValueError("parameter is not sharded (it has no shard_layout)")
    if old == layout:
        return False
    if old.group is not layout.group or old.dim != layout.dim or old.num_parts != layout.num_parts:
        raise ValueError(f"can only change widths: {old} -> {layout}")
    master, state = _stepped(optimizer, param)
    keys = _agreed_state_keys(state, param, master, old.group)
    _forget_grad_accumulator(param)
    param.data = reshard(param.data, old, layout)
    param.grad = _reshard_grad(param.grad, old, layout)
    if master is not param:
        master.data = reshard(master.data, old, layout)
        master.grad = _reshard_grad(master.grad, old, layout)
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
