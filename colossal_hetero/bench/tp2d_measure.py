"""What ``bench tp2d`` measures on a rank: activation bytes, the largest batch under a budget.

Activation bytes of one forward = the bytes of every distinct storage the autograd graph keeps
for the backward, parameters excluded. Two kinds of tensor are kept:

- tensors saved through autograd (built-in ops and ``ctx.save_for_backward``): seen by
  ``torch.autograd.graph.saved_tensors_hooks`` as they are saved;
- tensors a custom ``autograd.Function`` stashes on its ``ctx`` as plain attributes (Colossal-AI's
  sequence-parallel linears keep their all-gathered input as ``ctx.gathered_input``): invisible
  to the hooks, found by walking the graph from the loss and reading each Python node's
  attributes.

A storage is counted once (views share it) with its full size (a view keeps all of it alive).
This is the memory the graph pins between forward and backward, the quantity activation
memory models (Korthikanti et al.) count; transient buffers freed inside the forward are not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from colossal_hetero.utils.device import is_host_backend


class GraphBytes:
    """Distinct storages a forward's autograd graph keeps, parameters excluded (see module)."""

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self._excluded = {_ptr(p) for p in parameters}
        self._storages: dict[int, int] = {}

    def _add(self, tensor: torch.Tensor) -> None:
        ptr = _ptr(tensor)
        if ptr and ptr not in self._excluded:
            size = tensor.untyped_storage().nbytes()
            self._storages[ptr] = max(self._storages.get(ptr, 0), size)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._add(tensor)
        return tensor

    @contextmanager
    def recording(self) -> Iterator[GraphBytes]:
        """Count what autograd saves inside the block."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _identity):
            yield self

    def add_stashed(self, root: torch.Tensor) -> None:
        """Add tensors that custom Functions keep on their ctx, walking the graph of ``root``."""
        seen: set[int] = set()
        alive: list[Any] = []  # keep visited nodes alive: ids of freed wrappers get reused
        stack = [root.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            alive.append(node)
            for value in getattr(node, "__dict__", {}).values():
                for tensor in _tensors(value):
                    self._add(tensor)
            stack.extend(next_node for next_node, _ in node.next_functions)

    @property
    def total(self) -> int:
        """Bytes counted so far."""
        return sum(self._storages.values())


def saved_by_op(root: torch.Tensor, parameters: Iterable[torch.Tensor]) -> dict[str, int]:
    """Bytes the graph of ``root`` keeps, by the backward node that keeps them (parameters
    excluded; a storage kept by several nodes goes to the first one met walking back from
    ``root``). Built-in nodes expose their saves as ``_saved_*`` attributes, custom Functions
    as ``saved_tensors`` and ctx attributes. For finding which op keeps what; the total equals
    ``forward_bytes``'s when every saved tensor is reachable this way."""
    excluded = {_ptr(p) for p in parameters}
    owner: dict[int, tuple[str, int]] = {}
    seen: set[int] = set()
    alive: list[Any] = []
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        alive.append(node)
        for tensor in _node_saves(node):
            ptr = _ptr(tensor)
            if ptr and ptr not in excluded and ptr not in owner:
                owner[ptr] = (type(node).__name__, tensor.untyped_storage().nbytes())
        stack.extend(next_node for next_node, _ in node.next_functions)
    totals: dict[str, int] = {}
    for name, size in owner.values():
        totals[name] = totals.get(name, 0) + size
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def _node_saves(node: Any) -> Iterator[torch.Tensor]:
    for attr in dir(node):
        if attr.startswith("_saved_"):
            try:
                yield from _tensors(getattr(node, attr))
            except RuntimeError:  # freed or not a tensor
                continue
    try:
        yield from _tensors(getattr(node, "saved_tensors", ()))
    except RuntimeError:
        pass
    for value in getattr(node, "__dict__", {}).values():
        yield from _tensors(value)


def forward_bytes(
    forward: Callable[[], torch.Tensor], parameters: Iterable[torch.Tensor]
) -> tuple[int, torch.Tensor]:
    """(activation bytes, loss) of one ``forward()``; the caller backpropagates or drops it."""
    counter = GraphBytes(parameters)
    with counter.recording():
        loss = forward()
    counter.add_stashed(loss)
    return counter.total, loss


def state_bytes(parameters: Iterable[torch.Tensor], *, copies: int = 4) -> int:
    """Bytes of a rank's distinct parameter storages times ``copies`` (weights, gradients and
    AdamW's two moments: 4)."""
    storages: dict[int, int] = {}
    for p in parameters:
        storages[_ptr(p)] = p.untyped_storage().nbytes()
    return copies * sum(storages.values())


def largest_fitting(fits: Callable[[int], bool], *, start: int, limit: int) -> int:
    """The largest n in [1, limit] with ``fits(n)``, assuming fits is monotone (true up to some
    n, false after); 0 when ``fits(1)`` is false. Doubling from ``start``, then bisection: about
    2 log2(n) calls of ``fits``."""
    if limit < 1:
        raise ValueError(f"largest_fitting: limit must be >= 1, got {limit}")
    low, high = 0, limit + 1  # fits(low) holds (or low == 0); fits(high) fails (or high > limit)
    probe = max(1, min(start, limit))
    while probe <= limit:
        if fits(probe):
            low = probe
            if probe == limit:
                return limit
            probe = min(2 * probe, limit)
        else:
            high = probe
            break
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def _identity(tensor: Any) -> Any:
    return tensor


def _ptr(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class _ListReduceScatterOnGloo:
    """``torch.distributed`` as Colossal-AI's shardformer operations see it, with list-form
    ``reduce_scatter`` (which gloo lacks) done as ``reduce_scatter_tensor`` of the concatenated
    inputs on gloo groups. Other names, and other backends, go to torch.distributed unchanged
    (looked up at call time, so wrappers installed on torch.distributed still see the call)."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def reduce_scatter(self, output, input_list, op=None, group=None, async_op=False):  # type: ignore[no-untyped-def]
        dist = self._module
        op = dist.ReduceOp.SUM if op is None else op
        if not is_host_backend(dist.get_backend(group)):
            return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
        flat = torch.cat([t.reshape(-1) for t in input_list])
        return dist.reduce_scatter_tensor(
            output.view(-1), flat, op=op, group=group, async_op=async_op
        )


@contextmanager
def sequence_parallel_on_gloo() -> Iterator[None]:
    """Let Colossal-AI 0.5's split_gather sequence parallelism run on gloo inside the block.

    Its shardformer operations call the list form of reduce_scatter, which ProcessGroupGloo
    does not implement; the module's ``dist`` name is pointed at a proxy for the block only.
    """
    import colossalai.shardformer.layer._operation as operation

    original = operation.dist
    operation.dist = _ListReduceScatterOnGloo(original)
    try:
        yield
    finally:
        operation.dist = original
