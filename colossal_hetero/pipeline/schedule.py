"""``KFKBSchedule``: Colossal-AI's pipeline schedule interface running the kFkB order.

A drop-in for ``OneForwardOneBackwardSchedule``: install it by assigning the plugin's
``scheduler`` (``HybridParallelPlugin(pp_style="1f1b", ...)`` builds the stage manager; our
plugin exposes it as ``plugin.engine``), and ``booster.execute_pipeline`` runs it.

What it reuses from Colossal-AI's 1F1B (by inheritance, so the arithmetic is the same): batch
loading and splitting, ``forward_step`` (the last stage's loss is divided by the micro-batch
count and accumulated in micro-batch order), ``backward_step``, and the forward-only path.
What it replaces: the order of passes (:func:`~colossal_hetero.pipeline.order.kfkb_order`) and
the point-to-point layer (:mod:`colossal_hetero.pipeline.p2p`): every send is non-blocking,
which keeps kFkB deadlock-free (a blocking send from stage s to s+1 could wait on s+1 while s+1
waits on a send to s), and every receive of a step is posted as soon as the step's first
message has given the shapes (gloo moves a message only once its receive is posted, so a
group's burst of sends flows while the receiver computes). Forward and backward passes each
run in increasing micro-batch order, exactly as in 1F1B, so parameter gradients accumulate in
the same order: with ``k = 1`` and any ``k`` alike, loss and gradients equal 1F1B's bit for
bit in fp32.

``k`` may change between steps (:meth:`KFKBSchedule.set_k`, also from ``before_step``, which runs
before any pass that depends on ``k``: every ``k``'s order opens with micro-batch 0's forward),
never within one; every rank of the pipeline must use the same ``k`` in a step (the Ada
tuner's decision is identical on every rank).

Backends: gloo only. NCCL runs all point-to-point operations between a pair of ranks on one
stream, in issue order, each blocking until matched; an early-posted receive would then hold
back the send its peer is waiting for. A NCCL version needs Colossal-AI-style fused
``batch_isend_irecv`` pairs; the constructor refuses NCCL groups rather than hang.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from colossalai.interface import ModelWrapper, OptimizerWrapper
from colossalai.pipeline.schedule import OneForwardOneBackwardSchedule
from colossalai.pipeline.schedule._utils import merge_batch
from colossalai.pipeline.stage_manager import PipelineStageManager
from torch.nn import Module

from colossal_hetero.emulation.router import flush_compute
from colossal_hetero.pipeline.order import Step, check_pipeline_args, kfkb_order
from colossal_hetero.pipeline.p2p import Inbox, LinkLog, Outbox, TPSlice
from colossal_hetero.pipeline.profile import RankRecord
from colossal_hetero.utils.device import current_device, is_host_backend


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one rank measured in one training step (seconds of wall time, bytes)."""

    forward_s: float
    """Mean seconds of a forward pass, from its input's arrival until its output's sends are
    issued (an emulated slow device's stretch of the pass happens at those sends)."""
    backward_s: float
    recv_wait_s: float
    """Total seconds the stage waited for activations and gradients to arrive."""
    send_wait_s: float
    """Seconds the stage waited at the step's end for its sends to complete."""
    sent_bytes: int
    """Bytes this rank put on its pipeline links this step (both directions)."""
    received_bytes: int
    step_s: float
    """Wall seconds of the whole step's schedule on this rank."""
    message_bytes: int
    """Tensor bytes of one activation message this rank put on its link to the next stage (0 on
    the last stage; its ``1/tp`` piece when messages are split over a TP group)."""
    activation_bytes: int
    """Most bytes autograd saved for one micro-batch's backward (parameters excluded; storages
    shared by several saved tensors counted once): what one in-flight micro-batch costs."""


class _StatsBuilder:
    """Accumulates one step's timings and counts the storages autograd saves in forwards."""

    def __init__(self, model: Module) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seconds = {"forward": 0.0, "backward": 0.0, "wait": 0.0}
        self.passes: dict[str, list[float]] = {"forward": [], "backward": []}
        """Each pass's seconds, in order."""
        self.message_bytes = 0
        self.activation_bytes = 0

    @contextmanager
    def _timed(self, what: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        took = time.perf_counter() - start
        self.seconds[what] += took
        if what in self.passes:
            self.passes[what].append(took)

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

    def build(self, num_microbatches: int, step_s: float, logs: dict[str, LinkLog]) -> StepStats:
        sends, recvs = (logs["to_next"], logs["to_prev"]), (logs["from_prev"], logs["from_next"])
        return StepStats(
            forward_s=self.seconds["forward"] / num_microbatches,
            backward_s=self.seconds["backward"] / num_microbatches,
            recv_wait_s=self.seconds["wait"],
            send_wait_s=sum(log.wait_s for log in sends),
            sent_bytes=sum(log.nbytes for log in sends),
            received_bytes=sum(log.nbytes for log in recvs),
            step_s=step_s,
            message_bytes=self.message_bytes,
            activation_bytes=self.activation_bytes,
        )


@dataclass(slots=True)
class _OrderRun:
    """What one step's passes share: the model and loss, where the loss and outputs go, the
    step's measurements, and the micro-batches in flight ``{mb: (input, output)}``."""

    model: Module
    criterion: Callable[..., Any]
    optimizer: OptimizerWrapper | None
    accum_loss: torch.Tensor | None
    outputs: list[Any] | None
    stats: _StatsBuilder
    saved: dict[int, tuple[Any, Any]] = field(default_factory=dict)


class KFKBSchedule(OneForwardOneBackwardSchedule):
    """kFkB pipeline schedule: groups of ``k`` forwards then ``k`` backwards (``k = 1`` is 1F1B).

    Args:
        stage_manager: the plugin's pipeline stage manager.
        num_microbatches / microbatch_size: as for ``OneForwardOneBackwardSchedule``.
        k: group size, ``1 <= k <= num_microbatches`` (checked when the batch is split).
        tp_group: the stage's 1D tensor-parallel group, whose ranks hold the same activations
            and input gradients: each rank then sends only its ``1/tp`` of every message and the
            receiving stage gathers the rest over its TP group (:class:`~colossal_hetero.
            pipeline.p2p.TPSlice`). None, or a group of one rank: whole messages.

    After each training step ``peak_saved`` holds the most micro-batches whose activations the
    stage kept at once (``min(k * (p - s), m)`` by construction), ``last_stats`` this rank's
    measurements (:class:`StepStats`) and ``last_record`` the same step as a
    :class:`~colossal_hetero.pipeline.profile.RankRecord` with per-message link timestamps: the
    inputs of the Ada tuner and of the simulator's validation.
    """

    def __init__(
        self,
        stage_manager: PipelineStageManager,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        k: int = 1,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(stage_manager, num_microbatches, microbatch_size)
        if k < 1:
            raise ValueError(f"k: the kFkB group size must be >= 1, got {k}")
        self.k = k
        self.peak_saved = 0
        self.last_stats: StepStats | None = None
        self.last_record: RankRecord | None = None
        """This rank's :class:`~colossal_hetero.pipeline.profile.RankRecord` of the last training
        step (gather every rank's for ``profile.predict_from_records``)."""
        self.before_step: Callable[[], None] | None = None
        """Called in every training step before ``k`` is read (the Ada controller's early
        decision: it may ``set_k``), once the step's receives are posted: on the first stage
        after micro-batch 0's forward and its send (the first pass of every ``k``), so the
        decision overlaps that activation's transfer rather than delaying the step's first
        pass; on the other stages before their first wait for data. Not part of ``step_s``."""
        device = current_device()
        group = stage_manager.get_p2p_process_group()
        if not is_host_backend(dist.get_backend(group)):
            raise ValueError(
                "parallel.pp_schedule: kfkb runs on gloo process groups only (see "
                "colossal_hetero/pipeline/schedule.py for why NCCL would hang)"
            )
        first, last = stage_manager.is_first_stage(), stage_manager.is_last_stage()
        prev, nxt = stage_manager.get_prev_rank(), stage_manager.get_next_rank()
        tp = _tp_slice(tp_group)
        self._to_next = None if last else Outbox(nxt, group, device, tp)
        self._to_prev = None if first else Outbox(prev, group, device, tp)
        self._from_prev = None if first else Inbox(prev, group, device, tp)
        self._from_next = None if last else Inbox(nxt, group, device, tp)

    def set_k(self, k: int) -> None:
        """Use group size ``k`` from the next step on (call on every pipeline rank alike)."""
        if self.num_microbatches is not None:
            check_pipeline_args(self.stage_manager.num_stages, self.num_microbatches, k)
        elif k < 1:
            raise ValueError(f"k: the kFkB group size must be >= 1, got {k}")
        self.k = k

    def set_link_units(
        self, forward: Sequence[tuple[int, ...]], backward: Sequence[tuple[int, ...]]
    ) -> None:
        """Carry each boundary's messages over its TP links in these units from the next step
        on (``forward[b]``: activations from stage ``b`` to ``b + 1``, one count per TP rank;
        ``backward[b]``: gradients back; see ``pipeline/link_shares.py``). Call between steps,
        on every pipeline rank alike: both ends of a link must cut messages the same way. A
        no-op without a TP group of several ranks."""
        p = self.stage_manager.num_stages
        if len(forward) != p - 1 or len(backward) != p - 1:
            raise ValueError(f"link units: need one entry per boundary ({p - 1})")
        s = self.stage_manager.stage
        boxes = [
            (box, box.tp, units)
            for box, units in (
                (self._to_next, forward[s] if s < p - 1 else None),
                (self._from_next, backward[s] if s < p - 1 else None),
                (self._from_prev, forward[s - 1] if s > 0 else None),
                (self._to_prev, backward[s - 1] if s > 0 else None),
            )
            if box is not None and box.tp is not None and units is not None
        ]
        for _, tp, units in boxes:  # every box checked before any changes
            if len(units) != tp.size or min(units) < 1:
                raise ValueError(f"link units: need {tp.size} counts >= 1, got {units}")
        for box, tp, units in boxes:
            # Equal counts are the equal pieces (a tensor TP does not divide travels whole).
            box.tp = replace(tp, units=tuple(units) if len(set(units)) > 1 else ())

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
        begin = time.perf_counter()
        self.load_batch(data_iter)
        m, sm = self.num_microbatches, self.stage_manager
        assert m is not None
        check_pipeline_args(sm.num_stages, m, self.k)  # before any message: k > m raises
        for inbox in (self._from_prev, self._from_next):
            if inbox is not None:
                inbox.start(m)
        accum_loss = None
        if return_loss and sm.is_last_stage():
            accum_loss = torch.scalar_tensor(0, device=current_device())
        outputs: list[Any] | None = [] if return_outputs and sm.is_last_stage() else None
        stats = _StatsBuilder(model)
        run = _OrderRun(model, criterion, optimizer, accum_loss, outputs, stats)
        self.peak_saved = 0
        # Every k's order opens with micro-batch 0's forward. The first stage runs it before
        # the hook decides k, so the decision overlaps its activation's transfer instead of
        # delaying the step's first pass; the other stages decide while that activation is on
        # its way to them (their first receive is posted, not yet waited for).
        first = self.before_step is not None and sm.is_first_stage()
        head: list[Step] = [("F", 0)] if first else []
        self._run_order(head, run)
        deciding = self._run_before_step()
        order = kfkb_order(sm.num_stages, sm.stage, m, self.k)  # ValueError if k > m
        assert order[: len(head)] == head, "every kFkB order opens with micro-batch 0's forward"
        self._run_order(order[len(head) :], run)
        assert not run.saved
        for outbox in (self._to_next, self._to_prev):
            if outbox is not None:
                outbox.finish()
        self._record(stats, m, time.perf_counter() - begin - deciding)
        if outputs is not None:
            if isinstance(model, ModelWrapper):
                model = model.unwrap()
            outputs = merge_batch(outputs, getattr(model, "batch_size_dim", 0))
        return {"loss": accum_loss, "outputs": outputs}

    def _run_before_step(self) -> float:
        """Call ``before_step`` (if set); the seconds it took, which ``step_s`` leaves out."""
        if self.before_step is None:
            return 0.0
        began = time.perf_counter()
        self.before_step()
        return time.perf_counter() - began

    def _run_order(self, order: Sequence[Step], run: _OrderRun) -> None:
        """Run ``order``'s passes (part of one step's); a pass's timing includes issuing its
        sends. ``run.saved`` carries the micro-batches in flight from one part to the next."""
        stats, saved = run.stats, run.saved
        for op, mb in order:
            if op == "F":
                with stats.waiting():
                    input_obj = None if self._from_prev is None else self._from_prev.get()
                with stats.forward():
                    output_obj = self.forward_step(
                        run.model, input_obj, run.criterion, run.accum_loss, run.outputs
                    )
                    flush_compute()  # an emulated slow device's stretch belongs to the pass
                    if self._to_next is not None:
                        stats.message_bytes = self._to_next.send(output_obj)
                saved[mb] = (input_obj, output_obj)
                self.peak_saved = max(self.peak_saved, len(saved))
            else:
                with stats.waiting():
                    grad = None if self._from_next is None else self._from_next.get()
                input_obj, output_obj = saved.pop(mb)
                with stats.backward():
                    input_grad = self.backward_step(run.optimizer, input_obj, output_obj, grad)
                    flush_compute()
                    if self._to_prev is not None:
                        self._to_prev.send(input_grad)

    def _record(self, stats: _StatsBuilder, m: int, step_s: float) -> None:
        """Set ``last_stats`` and ``last_record`` from this step's measurements and link logs."""
        boxes = {
            "to_next": self._to_next,
            "to_prev": self._to_prev,
            "from_prev": self._from_prev,
            "from_next": self._from_next,
        }
        logs = {name: LinkLog() if box is None else box.take_log() for name, box in boxes.items()}
        self.last_stats = stats.build(m, step_s, logs)
        sm = self.stage_manager
        inboxes = (self._from_prev, self._from_next)
        self.last_record = RankRecord(
            rank=dist.get_rank(),
            stage=sm.stage,
            next_rank=None if sm.is_last_stage() else sm.get_next_rank(),
            # The median pass: a tensor-parallel pass that started before its peer did also
            # waited for the peer's input inside it; that wait is the link's (modelled apart).
            forward_s=statistics.median(stats.passes["forward"] or [0.0]),
            backward_s=statistics.median(stats.passes["backward"] or [0.0]),
            step_s=step_s,
            activation_bytes=float(self.last_stats.activation_bytes),
            message_bytes=float(self.last_stats.message_bytes),
            sent_next=tuple(logs["to_next"].times),
            arrived_prev=tuple(logs["from_prev"].times),
            posted_prev=tuple(logs["from_prev"].posted),
            sent_prev=tuple(logs["to_prev"].times),
            arrived_next=tuple(logs["from_next"].times),
            posted_next=tuple(logs["from_next"].posted),
            asked_prev=tuple(logs["from_prev"].asked),
            asked_next=tuple(logs["from_next"].asked),
            overhead_s=_overhead_s(stats, step_s, logs),
            first_early=float(any(b is not None and b.first_early for b in inboxes)),
        )


def _tp_slice(group: dist.ProcessGroup | None) -> TPSlice | None:
    """This rank's :class:`TPSlice` of ``group``; None without a group of several ranks."""
    if group is None or dist.get_world_size(group) < 2:
        return None
    return TPSlice(group, dist.get_rank(group), dist.get_world_size(group))


def _overhead_s(stats: _StatsBuilder, step_s: float, logs: dict[str, LinkLog]) -> float:
    """Seconds of the step in no pass and not blocked for data: ``step_s`` less the passes,
    the receives' waits (TP gathers included) and the final wait for sends."""
    blocked = sum(logs[name].wait_s for name in ("from_prev", "from_next"))
    sends = sum(logs[name].wait_s for name in ("to_next", "to_prev"))
    passes = stats.seconds["forward"] + stats.seconds["backward"]
    return max(0.0, step_s - passes - blocked - sends)
