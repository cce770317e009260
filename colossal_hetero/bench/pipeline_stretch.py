"""Half-speed stage for ``bench pipeline`` scenario (c): stretch each block's own compute.

The collective interceptor stretches a rank's compute at its next collective, and it does not
see ``KFKBSchedule``'s ``isend``/``irecv``: under it, a stage would be slowed where Colossal-AI's
1F1B talks (``send``/``recv``) and not where kFkB does, which would favour one schedule. This
stretch is the same for every variant: around each transformer block that runs on a slowed
rank, it measures the wall time of the block's forward and of its backward and sleeps
``(factor - 1)`` times that, right after; the sleep burns no CPU. Wall time, not the thread's
CPU time: on a shared, oversubscribed machine a block's compute takes several times its CPU
time in wall time (the rank waits for a core), and that wall time is what the neighbouring
stages wait for; stretching only the CPU time would make "half speed" a far smaller slowdown
than it says.

Backward is bracketed by two identity autograd functions: one on the block's output (its
backward runs first, and starts the clock) and one on the block's input (its backward runs
once the block's backward is done, and sleeps). On CPU autograd runs backward on the calling
thread, one block after another, so the two marks bracket exactly that block's backward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


class Stretch:
    """Shared switch and clock of one rank's stretched blocks; ``enabled`` toggles all of them."""

    def __init__(self, factor: float, sleep: Callable[[float], None] = time.sleep) -> None:
        """``sleep`` is a seam for tests; every stretch is one call of it."""
        if factor < 1.0:
            raise ValueError(f"factor: a stretch slows down, need >= 1, got {factor}")
        self.factor, self._sleep = factor, sleep
        self.enabled = False
        self.slept_s = 0.0
        """Seconds slept so far (the emulated extra compute)."""
        self.backward_t0 = 0.0
        """Clock time when the running block's backward started."""
        self._handles: list[Any] = []

    def sleep_for(self, seconds: float) -> None:
        if self.enabled and seconds > 0.0:
            extra = (self.factor - 1.0) * seconds
            self.slept_s += extra
            self._sleep(extra)

    def attach(self, blocks: Iterable[nn.Module]) -> None:
        """Stretch every block in ``blocks`` (its first positional input is the hidden state)."""
        for block in blocks:
            self._handles.append(block.register_forward_pre_hook(self._before, with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._after))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        module._stretch_t0 = time.perf_counter()  # type: ignore[assignment]
        if not self.enabled or not args or not torch.is_tensor(args[0]):
            return None
        hidden = args[0]
        if hidden.requires_grad:
            hidden = _Mark.apply(hidden, self, True)
        return (hidden, *args[1:]), kwargs

    def _after(self, module: nn.Module, args: tuple, output: Any) -> Any:
        self.sleep_for(time.perf_counter() - module._stretch_t0)  # type: ignore[operator]
        if not self.enabled or not isinstance(output, tuple) or not torch.is_tensor(output[0]):
            return None
        if not output[0].requires_grad:
            return None
        return (_Mark.apply(output[0], self, False), *output[1:])


class _Mark(torch.autograd.Function):
    """Identity; its backward starts (``closes=False``) or ends and stretches (``True``) the
    clock of one block's backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stretch: Stretch, closes: bool) -> torch.Tensor:
        ctx.stretch, ctx.closes = stretch, closes
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        stretch: Stretch = ctx.stretch
        if ctx.closes:
            stretch.sleep_for(time.perf_counter() - stretch.backward_t0)
        else:
            stretch.backward_t0 = time.perf_counter()
        return grad, None, None
