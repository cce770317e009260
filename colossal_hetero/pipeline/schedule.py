"""``KFKBSchedule``: Colossal-AI's pipeline schedule interface running the kFkB order.

A drop-in for ``OneForwardOneBackwardSchedule``: install it by assigning the plugin's
``scheduler`` (``HybridParallelPlugin(pp_style="1f1b", ...)`` builds the stage manager; our
plugin exposes it as ``plugin.engine``), and ``booster.execute_pipeline`` runs it.

What it reuses from Colossal-AI's 1F1B (by inheritance, so the arithmetic is the same): batch
loading and splitting, ``forward_step`` (the last stage's loss is divided by the micro-batch
count and accumulated in micro-batch order), ``backward_step``, and the forward-only path.
What it replaces: the order of passes (:func:`~colossal_hetero.pipeline.order.kfkb_order`) and
the point-to-point layer (:mod:`colossal_hetero.pipeline.p2p`): every send is non-blocking and
the next receive of each direction is posted as soon as the previous one is taken, which is
what keeps kFkB deadlock-free (a blocking send from stage s to s+1 could wait on s+1 while s+1
waits on a send to s). Forward and backward passes each run in increasing micro-batch order,
exactly as in 1F1B, so parameter gradients accumulate in the same order: with ``k = 1`` and any
``k`` alike, loss and gradients equal 1F1B's bit for bit in fp32.

``k`` may change between steps (:meth:`KFKBSchedule.set_k`), never within one; every rank of the
pipeline must use the same ``k`` in a step (the Ada tuner's decision is identical on every rank).

Backends: gloo only. NCCL runs all point-to-point operations between a pair of ranks on one
stream, in issue order, each blocking until matched; an early-posted receive would then hold
back the send its peer is waiting for. A NCCL version needs Colossal-AI-style fused
``batch_isend_irecv`` pairs; the constructor refuses NCCL groups rather than hang.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from colossalai.interface import ModelWrapper, OptimizerWrapper
from colossalai.pipeline.schedule import OneForwardOneBackwardSchedule
from colossalai.pipeline.schedule._utils import merge_batch
from colossalai.pipeline.stage_manager import PipelineStageManager
from colossalai.utils import get_current_device
from torch.nn import Module

from colossal_hetero.pipeline.order import check_pipeline_args, kfkb_order
from colossal_hetero.pipeline.p2p import Inbox, Outbox


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one rank measured in one training step (seconds of wall time, bytes)."""

    forward_s: float
    """Mean seconds of a forward pass, from its input's arrival to its output."""
    backward_s: float
    recv_wait_s: float
    """Total seconds the stage waited for activations and gradients to arrive."""
    message_bytes: int
    """Tensor bytes of one activation message to the next stage (0 on the last stage)."""
    activation_bytes: int
    """Most bytes autograd saved for one micro-batch's backward (parameters excluded; storages
    shared by several saved tensors counted once): what one in-flight micro-batch costs."""


class _StatsBuilder:
    """Accumulates one step's timings and counts the storages autograd saves in forwards."""

    def __init__(self, model: Module) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seconds = {"forward": 0.0, "backward": 0.0, "wait": 0.0}
        self.message_bytes = 0
        self.activation_bytes = 0

    @contextmanager
    def _timed(self, what: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[what] += time.perf_counter() - start

    def waiting(self) -> AbstractContextManager[None]:
        return self._timed("wait")

    def backward(self) -> AbstractContextManager[None]:
        return self._timed("backward")

    @contextmanager
    def forward(self) -> Iterator[None]:
        seen: set[int] = set()
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._params and ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
            return t

        with self._timed("forward"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.activation_bytes = max(self.activation_bytes, total)

    def build(self, num_microbatches: int) -> StepStats:
        return StepStats(
            forward_s=self.seconds["forward"] / num_microbatches,
            backward_s=self.seconds["backward"] / num_microbatches,
            recv_wait_s=self.seconds["wait"],
            message_bytes=self.message_bytes,
            activation_bytes=self.activation_bytes,
        )


class KFKBSchedule(OneForwardOneBackwardSchedule):
    """kFkB pipeline schedule: groups of ``k`` forwards then ``k`` backwards (``k = 1`` is 1F1B).

    Args:
        stage_manager: the plugin's pipeline stage manager.
        num_microbatches / microbatch_size: as for ``OneForwardOneBackwardSchedule``.
        k: group size, ``1 <= k <= num_microbatches`` (checked when the batch is split).

    After each training step ``peak_saved`` holds the most micro-batches whose activations the
    stage kept at once (``min(k * (p - s), m)`` by construction) and ``last_stats`` this rank's
    measurements (:class:`StepStats`), the local inputs of the Ada tuner.
    """

    def __init__(
        self,
        stage_manager: PipelineStageManager,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        k: int = 1,
    ) -> None:
        super().__init__(stage_manager, num_microbatches, microbatch_size)
        if k < 1:
            raise ValueError(f"k: the kFkB group size must be >= 1, got {k}")
        self.k = k
        self.peak_saved = 0
        self.last_stats: StepStats | None = None
        device = get_current_device()
        group = stage_manager.get_p2p_process_group()
        if dist.get_backend(group) != "gloo":
            raise ValueError(
                "parallel.pp_schedule: kfkb runs on gloo process groups only (see "
                "colossal_hetero/pipeline/schedule.py for why NCCL would hang)"
            )
        first, last = stage_manager.is_first_stage(), stage_manager.is_last_stage()
        prev, nxt = stage_manager.get_prev_rank(), stage_manager.get_next_rank()
        self._to_next = None if last else Outbox(nxt, group, device)
        self._to_prev = None if first else Outbox(prev, group, device)
        self._from_prev = None if first else Inbox(prev, group, device)
        self._from_next = None if last else Inbox(nxt, group, device)

    def set_k(self, k: int) -> None:
        """Use group size ``k`` from the next step on (call on every pipeline rank alike)."""
        if self.num_microbatches is not None:
            check_pipeline_args(self.stage_manager.num_stages, self.num_microbatches, k)
        elif k < 1:
            raise ValueError(f"k: the kFkB group size must be >= 1, got {k}")
        self.k = k

    def run_forward_backward(
        self,
        model: Module,
        data_iter: Iterable,
        criterion: Callable[..., Any],
        optimizer: OptimizerWrapper | None = None,
        return_loss: bool = False,
        return_outputs: bool = False,
    ) -> dict:
        """One training step in kFkB order; returns ``{"loss", "outputs"}`` like 1F1B."""
        assert not self.forward_only
        self.load_batch(data_iter)
        m, sm = self.num_microbatches, self.stage_manager
        assert m is not None
        order = kfkb_order(sm.num_stages, sm.stage, m, self.k)  # ValueError if k > m
        for inbox in (self._from_prev, self._from_next):
            if inbox is not None:
                inbox.start(m)
        accum_loss = None
        if return_loss and sm.is_last_stage():
            accum_loss = torch.scalar_tensor(0, device=get_current_device())
        outputs: list[Any] | None = [] if return_outputs and sm.is_last_stage() else None
        saved: dict[int, tuple[Any, Any]] = {}
        self.peak_saved = 0
        stats = _StatsBuilder(model)
        for op, mb in order:
            if op == "F":
                with stats.waiting():
                    input_obj = None if self._from_prev is None else self._from_prev.get()
                with stats.forward():
                    output_obj = self.forward_step(model, input_obj, criterion, accum_loss, outputs)
                if self._to_next is not None:
                    stats.message_bytes = self._to_next.send(output_obj)
                saved[mb] = (input_obj, output_obj)
                self.peak_saved = max(self.peak_saved, len(saved))
            else:
                with stats.waiting():
                    grad = None if self._from_next is None else self._from_next.get()
                input_obj, output_obj = saved.pop(mb)
                with stats.backward():
                    input_grad = self.backward_step(optimizer, input_obj, output_obj, grad)
                if self._to_prev is not None:
                    self._to_prev.send(input_grad)
        for outbox in (self._to_next, self._to_prev):
            if outbox is not None:
                outbox.finish()
        assert not saved
        self.last_stats = stats.build(m)
        if outputs is not None:
            if isinstance(model, ModelWrapper):
                model = model.unwrap()
            outputs = merge_batch(outputs, getattr(model, "batch_size_dim", 0))
        return {"loss": accum_loss, "outputs": outputs}
