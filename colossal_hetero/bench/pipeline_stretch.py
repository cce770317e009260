"""Slow devices for ``bench pipeline`` scenario (c): stretch each block's own compute.

The collective interceptor stretches a rank's compute at its next collective, and it does not
see ``KFKBSchedule``'s ``isend``/``irecv``: under it, a stage would be slowed where Colossal-AI's
1F1B talks (``send``/``recv``) and not where kFkB does, which would favour one schedule. This
stretch is the same for every variant: around each transformer block that runs on a rank, it
times the block's forward and its backward and sleeps right after each; the sleep burns no CPU.

Two modes (``Stretch(mode=)``):

- ``added``: sleep ``(factor - 1)`` times the block's wall time. On a shared, oversubscribed
  machine that sleep hands the rank's core to its neighbours, which then run faster: 4 ranks
  on 2 cores are CPU-bound, and a slow stage that sleeps speeds up every other stage, so a
  split that moves blocks off it gains far less than the slowdown says.
- ``dedicated``: a full-speed device's pass lasts ``base`` times the thread's CPU time of it,
  sleeping what its (contended) wall time left: a device of its own, ``base`` times slower
  than a core, that no neighbour speeds up or slows down while the contention stays below
  ``base`` (as the interceptor's ``stretch="dedicated"``). A device at ``1 / factor`` speed
  then computes ``(factor - 1) * base`` times that CPU time longer, whatever else the pass's
  wall time held: a tensor-parallel block's all-reduce waits are no compute and do not hide
  the slow compute (before, a pass lasting ``base * factor * cpu`` in all let a block whose
  waits filled that time run at full speed: a "half-speed" TP=2 stage was only 1.17x slower
  per block). Every rank of the scenario runs on such devices, the slowed stage's with
  ``factor`` 2.

Backward is bracketed by two identity autograd functions: one on the block's output (its
backward runs first, and starts the clocks) and one on the block's input (its backward runs
once the block's backward is done, and sleeps). On CPU autograd runs backward on the calling
thread, one block after another, so the two marks bracket exactly that block's backward and
the thread's CPU time is that backward's work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn

DEVICE_BASE = 2.5
"""``dedicated`` mode: every emulated device this many times slower than a core (4 ranks on 2
cores make a block's wall time about twice its CPU time; the base absorbs that)."""


class Stretch:
    """Shared switch and clocks of one rank's stretched blocks; ``enabled`` toggles all of them."""

    def __init__(
        self,
        factor: float,
        sleep: Callable[[float], None] = time.sleep,
        *,
        mode: Literal["added", "dedicated"] = "added",
        base: float = DEVICE_BASE,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        """``sleep`` and ``cpu_clock`` are seams for tests; every stretch is one call of
        ``sleep``. ``base`` applies to ``dedicated`` mode only."""
        if factor < 1.0 or base < 1.0:
            raise ValueError(f"factor, base: a stretch slows down, need >= 1, got {factor}, {base}")
        self.factor, self.mode, self.base = factor, mode, base
        self._sleep, self._cpu = sleep, cpu_clock
        self.enabled = False
        self.slept_s = 0.0
        """Seconds slept so far (the emulated extra compute)."""
        self.passes_s = 0.0
        """Wall seconds of the stretched block passes so far, forward and backward, sleeps
        included: what the stage's blocks cost at its emulated speed."""
        self.passes = 0
        """Stretched block passes so far (a block's forward and its backward count one each)."""
        self.backward_t0 = (0.0, 0.0)
        """Wall and CPU clocks when the running block's backward started."""
        self._handles: list[Any] = []

    def clocks(self) -> tuple[float, float]:
        """(wall, thread CPU) now: what ``stretch_from`` measures a pass from."""
        return time.perf_counter(), self._cpu()

    def stretch_from(self, start: tuple[float, float]) -> None:
        """Sleep to make the pass begun at ``start`` (``clocks()``) as slow as the mode says."""
        if not self.enabled:
            return
        wall = time.perf_counter() - start[0]
        if self.mode == "dedicated":
            work = self.base * (self._cpu() - start[1])  # the pass's compute on a full device
            extra = max(0.0, work - wall) + (self.factor - 1.0) * work
        else:
            extra = (self.factor - 1.0) * wall
        if extra > 0.0:
            self.slept_s += extra
            self._sleep(extra)
        self.passes_s += time.perf_counter() - start[0]
        self.passes += 1

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
        module._stretch_t0 = self.clocks()  # type: ignore[assignment]
        if not self.enabled or not args or not torch.is_tensor(args[0]):
            return None
        hidden = args[0]
        if hidden.requires_grad:
            hidden = _Mark.apply(hidden, self, True)
        return (hidden, *args[1:]), kwargs

    def _after(self, module: nn.Module, args: tuple, output: Any) -> Any:
        self.stretch_from(module._stretch_t0)  # type: ignore[arg-type]
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
            stretch.stretch_from(stretch.backward_t0)
        else:
            stretch.backward_t0 = stretch.clocks()
        return grad, None, None
