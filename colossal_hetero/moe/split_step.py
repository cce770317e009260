"""The optimizer step of one gradient group while the other group's chunks are still on the wire.

The flush before ``optimizer.step()`` (:meth:`.comm.MoeComm.flush`) reduces two groups: the
experts' gradients (launched right after the step's last a2a) and the dense ones (launched
at the end of backward). The expert group is usually reduced first and the rank then only
waits for the dense chunk. :func:`flush_then_step` steps the optimizer on a group's
parameters as soon as that group is reduced while the other still has a chunk in flight,
then steps the rest once the flush has ended: the experts' update (two thirds of the
parameters in ``bench moe``) overlaps the dense transfer instead of following it.

This is the same update as one step over all parameters only for optimizers that update
each parameter from its own gradient and state alone, so it is used only when
:func:`splittable` says so: a plain torch optimizer of an element-wise kind (its exact
class), inside Colossal-AI's naive (fp32) or bf16 wrapper, with no gradient clipping (a
global norm) and no fp16 loss scaling (its overflow check spans every gradient). Otherwise,
and for a step with a closure, the flush is followed by one ordinary step.

The early step calls the wrapper's class ``step`` on parameter groups restricted to the
group's parameters, so wrappers on the instance (the step seam's end-of-step hook) run once,
with the final step. The final step runs over the whole groups with the early parameters'
gradients hidden (None), because the seam's controllers may change the groups inside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from colossalai.amp.naive_amp.mixed_precision_mixin import BF16MixedPrecisionMixin

from colossal_hetero.moe.comm import MoeComm
from colossal_hetero.moe.scheduler import ChunkedGradReducer

ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
)
"""Torch optimizers whose update of a parameter reads only its gradient, state and group."""


def splittable(optimizer: Any) -> bool:
    """Whether stepping ``optimizer`` (a torch optimizer or Colossal-AI's wrapper of one) on
    disjoint parameter subsets, one after the other, equals one step over all of them."""
    inner = getattr(optimizer, "optim", optimizer)
    if type(inner) not in ELEMENTWISE:
        return False
    if float(getattr(optimizer, "max_norm", 0.0) or 0.0) > 0:
        return False
    mixed = getattr(optimizer, "mixed_precision", None)
    return mixed is None or isinstance(mixed, BF16MixedPrecisionMixin)


@contextmanager
def restricted(optimizer: Any, params: Sequence[torch.nn.Parameter], keep: bool) -> Iterator[None]:
    """Within the block, ``optimizer``'s parameter groups hold only ``params`` (``keep``) or
    only the others (their fp32 master copies where the wrapper keeps them); restored after."""
    inner = getattr(optimizer, "optim", optimizer)
    masters = getattr(optimizer, "working_to_master_map", {})
    chosen = {id(masters.get(p, p)) for p in params}
    saved = [group["params"] for group in inner.param_groups]
    try:
        for group in inner.param_groups:
            group["params"] = [q for q in group["params"] if (id(q) in chosen) == keep]
        yield
    finally:
        for group, original in zip(inner.param_groups, saved, strict=True):
            group["params"] = original


@contextmanager
def hidden_grads(optimizer: Any, params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """Within the block the (master) gradients of ``params`` are None, so a step over all
    parameter groups skips them (torch optimizers skip parameters without a gradient); they
    are put back after. The groups themselves are left alone: the step seam's controllers,
    which run inside the final step, may change them (expert re-placement, moe/replace.py)."""
    masters = getattr(optimizer, "working_to_master_map", {})
    saved = [(m, m.grad) for m in (masters.get(p, p) for p in params)]
    for master, _ in saved:
        master.grad = None
    try:
        yield
    finally:
        for master, grad in saved:
            if master.grad is None:
                master.grad = grad


def flush_then_step(optimizer: Any, step: Callable[..., Any], comm: MoeComm) -> Callable[..., Any]:
    """``optimizer.step`` (``step``: the instance's current one) that flushes ``comm``'s
    reducers first, stepping each group reduced early on its own (see the module)."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not comm.split_step or not splittable(optimizer):
            comm.flush()
            return step(*args, **kwargs)
        early: list[torch.nn.Parameter] = []

        def on_reduced(name: str, reducer: ChunkedGradReducer) -> None:
            params = reducer.parameters
            start = time.perf_counter()
            with restricted(optimizer, params, keep=True):
                type(optimizer).step(optimizer)
            comm.optim_steps.append((name, start, time.perf_counter()))
            early.extend(params)

        comm.flush(on_reduced)
        if not early:
            return step()
        with hidden_grads(optimizer, early):
            return step()

    return wrapped
