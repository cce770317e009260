"""The torch.distributed functions the interceptor wraps, and the modelled time of each call.

Each entry reads the call's own arguments (by name or position, per the wrapped function's
signature) to find the bytes moved and the group's global ranks, then asks the
``NetworkModel``. Object collectives have no cost of their own: the tensor collectives they
call inside are modelled instead (see ``CollectiveInterceptor``).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from colossal_hetero.emulation.network import NetworkModel


class CallArgs:
    """Arguments of one call, looked up by parameter name whatever way they were passed."""

    __slots__ = ("args", "kwargs", "_positions")

    def __init__(self, positions: dict[str, int], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self._positions, self.args, self.kwargs = positions, args, kwargs

    def get(self, name: str, default: Any = None) -> Any:
        """The argument ``name``, or ``default`` when the caller left it out."""
        if name in self.kwargs:
            return self.kwargs[name]
        index = self._positions.get(name, len(self.args))
        return self.args[index] if index < len(self.args) else default


def parameter_positions(fn: Callable[..., Any]) -> dict[str, int]:
    """Parameter name -> position, read once per wrapped function (follows ``__wrapped__``)."""
    return {name: i for i, name in enumerate(inspect.signature(fn).parameters)}


@dataclass(frozen=True, slots=True)
class ModelContext:
    """What a cost function needs besides the call: the model, this rank, the step."""

    network: NetworkModel
    rank: int
    world_size: int
    step: int

    def ranks(self, group: dist.ProcessGroup | None) -> list[int]:
        """Global ranks of ``group`` in group order; None is WORLD."""
        if group is None or group is dist.GroupMember.WORLD:
            return list(range(self.world_size))
        return dist.get_process_group_ranks(group)


# A cost function: (context, call arguments, the call's return value) -> seconds.
CostFn = Callable[[ModelContext, CallArgs, Any], float]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _total(tensors: Sequence[torch.Tensor]) -> int:
    return sum(_nbytes(t) for t in tensors)


def _all_reduce(ctx: ModelContext, call: CallArgs, _: Any) -> float:
    ranks = ctx.ranks(call.get("group"))
    return ctx.network.all_reduce_time(ranks, _nbytes(call.get("tensor")), ctx.step)


def _gathered(arg: str, list_arg: bool) -> CostFn:
    """All-gather / reduce-scatter cost from the full tensor (or list of pieces) ``arg``."""

    def cost(ctx: ModelContext, call: CallArgs, _: Any) -> float:
        full = call.get(arg)
        total = _total(full) if list_arg else _nbytes(full)
        return ctx.network.all_gather_time(ctx.ranks(call.get("group")), total, ctx.step)

    return cost


def _all_to_all(arg: str, list_arg: bool) -> CostFn:
    def cost(ctx: ModelContext, call: CallArgs, _: Any) -> float:
        local = call.get(arg)
        nbytes = _total(local) if list_arg else _nbytes(local)
        return ctx.network.all_to_all_time(ctx.ranks(call.get("group")), nbytes, ctx.step)

    return cost


def _tree(ctx: ModelContext, call: CallArgs, _: Any) -> float:
    ranks = ctx.ranks(call.get("group"))
    return ctx.network.broadcast_time(ranks, _nbytes(call.get("tensor")), ctx.step)


def _rooted(root_arg: str) -> CostFn:
    """Gather to / scatter from a root: each rank holds ``tensor``, the root moves n of them."""

    def cost(ctx: ModelContext, call: CallArgs, _: Any) -> float:
        ranks = ctx.ranks(call.get("group"))
        total = _nbytes(call.get("tensor")) * len(ranks)
        return ctx.network.gather_time(ranks, call.get(root_arg, 0), total, ctx.step)

    return cost


def _send(ctx: ModelContext, call: CallArgs, _: Any) -> float:
    return ctx.network.p2p_time(ctx.rank, call.get("dst"), _nbytes(call.get("tensor")), ctx.step)


def _recv(ctx: ModelContext, call: CallArgs, source: Any) -> float:
    # recv(src=None) receives from any rank and returns the sender's global rank.
    src = call.get("src")
    src = source if src is None else src
    return ctx.network.p2p_time(src, ctx.rank, _nbytes(call.get("tensor")), ctx.step)


def _batch_p2p(ctx: ModelContext, call: CallArgs, _: Any) -> float:
    """The ops of a batch run concurrently and links are full-duplex: bytes add up per
    direction of a link, and the batch takes as long as its slowest direction."""
    nbytes: dict[tuple[int, int], int] = defaultdict(int)
    for op in call.get("p2p_op_list"):
        pair = (ctx.rank, op.peer) if op.op is dist.isend else (op.peer, ctx.rank)
        nbytes[pair] += _nbytes(op.tensor)
    return max((ctx.network.p2p_time(s, d, b, ctx.step) for (s, d), b in nbytes.items()), default=0)


def _barrier(ctx: ModelContext, call: CallArgs, _: Any) -> float:
    return ctx.network.barrier_time(ctx.ranks(call.get("group")), ctx.step)


COST_FNS: dict[str, CostFn | None] = {
    "all_reduce": _all_reduce,
    "all_gather": _gathered("tensor_list", list_arg=True),
    "all_gather_into_tensor": _gathered("output_tensor", list_arg=False),
    "reduce_scatter": _gathered("input_list", list_arg=True),
    "reduce_scatter_tensor": _gathered("input", list_arg=False),
    "all_to_all": _all_to_all("input_tensor_list", list_arg=True),
    "all_to_all_single": _all_to_all("input", list_arg=False),
    "broadcast": _tree,
    "reduce": _tree,
    "send": _send,
    "recv": _recv,
    "batch_isend_irecv": _batch_p2p,
    "barrier": _barrier,
    "gather": _rooted("dst"),
    "scatter": _rooted("src"),
    # Pickled sizes are unknown up front: the tensor collectives they run inside are modelled.
    "all_gather_object": None,
    "broadcast_object_list": None,
}
"""Every wrapped function name -> its cost function (None: cost of its nested calls)."""

WRAPPED_NAMES: tuple[str, ...] = tuple(COST_FNS)
