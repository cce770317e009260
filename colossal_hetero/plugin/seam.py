"""The step seam: where a training step begins and ends, for the plugin and its controllers.

Everything that acts per step (the interceptor's timing and emulation, the metrics writer, and
the runtime controllers) learns the step boundaries here, so a plain ``Booster`` loop gets
them without calling anything:

- A step **opens** at the first forward of the boosted model that trains (the model is in
  training mode and autograd is on), at ``plugin.execute_pipeline`` (so that the step spans
  every micro-batch, and a later stage's wait for activations is inside it), or explicitly
  with ``begin_step(step)``. A forward while a step is open continues it (gradient
  accumulation, micro-batches).
- A step **closes** right after the boosted optimizer's ``step()`` returns, or explicitly with
  ``end_step()``. ``zero_grad`` plays no part.
- Forwards in eval mode or under ``torch.no_grad()`` / ``inference_mode`` never open a step:
  validation between steps is neither timed nor emulated, and does not shift step numbers.

Explicit and automatic driving mix: a step opened by ``begin_step`` is not reopened by the
forward hook, and the optimizer's ``step()`` still closes it; ``end_step()`` then returns the
timing of that already closed step. Steps are numbered from 0, or continue from the number
last given to ``begin_step``.

Controllers are plain objects with any of ``on_step_begin(step)``, ``on_step_end(step,
timing)`` and ``close()``. They run outside the timed step: ``on_step_begin`` before the clock
starts, ``on_step_end`` after it stops, so their own collectives are not charged to the step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from colossal_hetero.emulation import CollectiveInterceptor, StepTiming
from colossal_hetero.metrics.records import MetricsWriter, StepRecord, rank_metrics_path


class StepSeam:
    """Step boundaries of one plugin, its clock (the collective interceptor) and controllers.

    Args:
        clock: an installed interceptor; it times (and, if configured, emulates) each step.
    """

    def __init__(self, clock: CollectiveInterceptor) -> None:
        self.clock = clock
        self.last_timing: StepTiming | None = None
        # Mean loss of the last closed step's backward calls on this rank (None if unseen).
        self.loss: float | None = None
        self._controllers: list[Any] = []
        self._step: int | None = None  # the open step
        self._next = 0
        self._unclaimed: StepTiming | None = None  # closed by the optimizer, for end_step()
        self._losses: list[torch.Tensor] = []
        self._hooks: list[Any] = []

    @property
    def open_step(self) -> int | None:
        """The step open now, or None between steps."""
        return self._step

    def add(self, controller: Any) -> Any:
        """Register ``controller`` (hooks ``on_step_begin``, ``on_step_end``, ``close``, all
        optional); returns it. Controllers run in the order added."""
        self._controllers.append(controller)
        return controller

    def begin_step(self, step: int | None = None) -> int:
        """Open ``step`` (default: the one after the last closed step); returns its number.

        Raises:
            RuntimeError: a step is open already.
        """
        if self._step is not None:
            raise RuntimeError(f"begin_step({step}) while step {self._step} is still open")
        step = self._next if step is None else step
        self._unclaimed, self._losses = None, []
        for controller in self._controllers:
            if hasattr(controller, "on_step_begin"):
                controller.on_step_begin(step)
        self.clock.begin_step(step)
        self._step = step
        return step

    def end_step(self) -> StepTiming:
        """Close the open step and return its timing; if the optimizer's ``step()`` closed it
        already, return that step's timing.

        Raises:
            RuntimeError: no step is open and none was closed since the last ``end_step``.
        """
        if self._step is None:
            timing, self._unclaimed = self._unclaimed, None
            if timing is None:
                raise RuntimeError("end_step() without an open step")
            return timing
        return self._close()

    def note_loss(self, loss: Any) -> None:
        """Record a loss of the open step (a tensor; kept on device until the step closes)."""
        if self._step is not None and isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())

    def ensure_open(self) -> None:
        """Open the next step unless one is open (the automatic opening)."""
        if self._step is None:
            self.begin_step()

    def attach(self, model: nn.Module, optimizer: Any = None, *, note_losses: bool = True) -> None:
        """Drive the seam from ``model``'s training forwards and ``optimizer.step()``.

        ``model`` and ``optimizer`` are the booster's: a forward pre-hook goes on the model, and
        the optimizer object's ``step`` (and, with ``note_losses``, ``backward``, which
        ``booster.backward`` calls) is wrapped on the instance; the class is untouched.
        """
        self._hooks.append(model.register_forward_pre_hook(self._on_forward))
        if optimizer is None:
            return
        optimizer.step = _after(optimizer.step, self._on_optimizer_step)
        if note_losses and hasattr(optimizer, "backward"):
            optimizer.backward = _before(optimizer.backward, self.note_loss)

    def close(self) -> None:
        """Remove the forward hooks and close the controllers. An open step is abandoned."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._step = None
        for controller in self._controllers:
            if hasattr(controller, "close"):
                controller.close()

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if self._step is None and module.training and torch.is_grad_enabled():
            self.begin_step()

    def _on_optimizer_step(self) -> None:
        if self._step is not None:
            self._unclaimed = self._close()

    def _close(self) -> StepTiming:
        step = self._step
        assert step is not None  # callers check
        timing = self.clock.end_step()
        self._step, self._next, self.last_timing = None, step + 1, timing
        losses, self._losses = self._losses, []
        self.loss = float(torch.stack(losses).float().mean()) if losses else None
        for controller in self._controllers:
            if hasattr(controller, "on_step_end"):
                controller.on_step_end(step, timing)
        return timing


def _after(method: Callable[..., Any], then: Callable[[], None]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        then()
        return result

    return wrapped


def _before(method: Callable[..., Any], first: Callable[[Any], None]) -> Callable[..., Any]:
    def wrapped(loss: Any, *args: Any, **kwargs: Any) -> Any:
        first(loss)
        return method(loss, *args, **kwargs)

    return wrapped


class StepMetrics:
    """A seam controller writing one ``StepRecord`` per closed step to this rank's
    ``metrics_rank{rank}.jsonl`` in ``folder`` (appending; see metrics/records.py)."""

    def __init__(self, seam: StepSeam, folder: str | Path, rank: int) -> None:
        self.seam, self.rank = seam, rank
        self.writer = MetricsWriter(rank_metrics_path(folder, rank))

    def on_step_end(self, step: int, timing: StepTiming) -> None:
        self.writer.write(step_record(timing, self.rank, self.seam.loss))

    def close(self) -> None:
        self.writer.close()


def step_record(timing: StepTiming, rank: int, loss: float | None, **extra: Any) -> StepRecord:
    """The metrics record of one step's ``timing`` on ``rank``; ``extra`` sets optional fields
    (``lr``, ``val_loss``, ...). Shared by the seam's writer and the trainer."""
    return StepRecord(
        step=timing.step,
        rank=rank,
        step_time=timing.step_time,
        compute_time=timing.compute_time,
        comm_wait=timing.comm_wait,
        loss=loss,
        stretch_time=timing.stretch_time,
        network_delay=timing.network_delay,
        bytes_by_kind=timing.bytes_by_kind,
        wait_by_kind=timing.wait_by_kind,
        **extra,
    )
