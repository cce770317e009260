"""A run's full state, gathered and loaded again: the like-with-like reference for resizing.

Resizing claims to move bits. A run resized from widths A to B must therefore continue exactly
as a run stopped at A, whose full state (weights, gradients, optimizer state) is gathered and
loaded into a fresh run at B: from then on both run the same kernels on the same shard shapes
in the same reduction order, so they agree bitwise. A run at B throughout is no such
reference: it sums in another order, and Adam turns the rounding noise of near-zero gradients
into O(lr) weight differences, which no tolerance that still catches a bug can absorb.
"""

from __future__ import annotations

from typing import Any

import torch

from colossal_hetero.layers import layout_of


def gather_full(model: Any, optimizer: Any) -> dict[str, Any]:
    """Every tensor a resize moves, at full size, cloned.

    Keys: ``name`` (weight), ``name.grad``, ``name.<key>`` per optimizer state entry, and under
    mixed precision ``name.master``, ``name.master_grad``. ``model`` and ``optimizer`` are the
    booster's. Collectives: one all-gather per sharded tensor over its TP group, in parameter
    order (every rank of the group must call this).
    """
    to_master = getattr(optimizer, "working_to_master_map", {})
    state = optimizer.optim.state
    out: dict[str, Any] = {}
    for name, param in model.unwrap().named_parameters():
        layout = layout_of(param)

        def full(tensor: torch.Tensor, layout=layout) -> torch.Tensor:
            return layout.gather(tensor) if layout is not None else tensor.detach().clone()

        master = to_master.get(param, param)
        tensors = {"": param.data, ".grad": param.grad}
        if master is not param:
            tensors.update({".master": master.data, ".master_grad": master.grad})
        for suffix, tensor in tensors.items():
            if tensor is not None:
                out[name + suffix] = full(tensor)
        for key, value in state.get(master, {}).items():
            if torch.is_tensor(value) and value.dim() and value.shape == master.shape:
                out[f"{name}.{key}"] = full(value)
            else:  # Adam's step count: a scalar tensor it increments in place
                out[f"{name}.{key}"] = value.clone() if torch.is_tensor(value) else value
    return out


def load_full(
    model: Any, optimizer: Any, full: dict[str, Any], state_keys: tuple[str, ...]
) -> None:
    """Load a :func:`gather_full` state into a freshly boosted run, at its own widths.

    Each tensor is sliced by the parameter's own layout (no communication): weights, mixed
    precision masters, the gradients ``full`` holds (others are cleared), and the optimizer
    state entries ``state_keys`` (Adam: ``step``, ``exp_avg``, ``exp_avg_sq``), which replace
    the optimizer's state of every parameter (of its master under mixed precision).
    """
    to_master = getattr(optimizer, "working_to_master_map", {})
    state = optimizer.optim.state
    for name, param in model.unwrap().named_parameters():
        layout = layout_of(param)

        def local(key: str, layout=layout) -> torch.Tensor | None:
            tensor = full.get(key)
            if tensor is None or not tensor.dim():
                return None if tensor is None else tensor.clone()
            return layout.shard(tensor).clone() if layout is not None else tensor.clone()

        master = to_master.get(param, param)
        with torch.no_grad():
            param.copy_(local(name))
            if master is not param:
                master.copy_(local(name + ".master"))
        param.grad = local(name + ".grad")
        if master is not param:
            master.grad = local(name + ".master_grad")
        state[master] = {key: local(f"{name}.{key}") for key in state_keys}
