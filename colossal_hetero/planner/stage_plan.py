"""The pipeline part of a plan: layers per stage, micro-batch count and kFkB ``k``. Pure.

From a :class:`~colossal_hetero.planner.spec.ModelSpec` (the chain of layers the HAP planner
reads) and a :class:`~colossal_hetero.planner.spec.ClusterSpec` (per-device FLOP/s, memory and
link bandwidth), :func:`plan_stages`:

1. groups the spec into the repeated transformer blocks (the layers whose names carry a block
   index, ``transformer.h.3.mlp.c_fc``) plus what comes before them (embeddings: stage 0) and
   after them (final norm, LM head, loss: the last stage), as Colossal-AI's pipeline policies
   place them;
2. gives each stage its speed (``stages.stage_speeds``: its tensor-parallel devices add up, its
   slowest data-parallel replica counts) and memory (likewise), and splits the blocks with
   ``stages.split_layers``: the slowest stage's time is minimised, and no stage holds more
   blocks than its memory has room for (weights, gradients, optimizer states);
3. chooses the micro-batch count and ``k`` with ``stages.choose_microbatches`` (the pipeline
   simulator over every divisor of the pipeline's batch), with the memory left after the
   states as each stage's activation budget and the slower link of each boundary's devices.

The embeddings and the LM head are balanced too (``balance_ends``): over a large vocabulary the
head costs several blocks, and the last stage then gets fewer blocks even on equal devices.
Without them, equal devices give exactly Colossal-AI's even split (``split_layers``' tie rule).
The plugin plans stages only for heterogeneous clusters; on equal devices it keeps the even
split, as before.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from colossal_hetero.pipeline.tuner import choose_k
from colossal_hetero.planner.cost import BACKWARD_FLOPS_FACTOR
from colossal_hetero.planner.spec import ClusterSpec, LayerSpec, ModelSpec
from colossal_hetero.planner.stages import (
    MicrobatchChoice,
    PipelineCosts,
    StageTimes,
    affine_block_seconds,
    choose_microbatches,
    even_split,
    split_from_times,
    stage_speeds,
)

_BLOCK = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class BlockCosts:
    """Per-sample costs of a model's parts, at one FLOP/s (divide by a stage's FLOP/s)."""

    num_blocks: int
    block_flops: float
    """Forward FLOPs of one block per sample (backward counts twice)."""
    head_flops: float
    """Forward FLOPs per sample of what precedes the blocks (on the first stage)."""
    tail_flops: float
    """... and of what follows them (on the last stage)."""
    block_state_bytes: float
    """Weights, gradients and optimizer states of one block."""
    head_state_bytes: float
    tail_state_bytes: float
    block_activation_bytes: float
    """Activation bytes one block keeps per sample for its backward."""
    message_bytes: float
    """Bytes per sample of the hidden states passed between stages."""
    block_layers: int = 1
    """Layers in one block: each pays the fixed per-layer overhead once per micro-batch."""


def _flops(layers: list[LayerSpec]) -> float:
    return sum(la.flops_per_token * la.tokens for la in layers)


def _state(layers: list[LayerSpec], per_param: int) -> float:
    # A tied LM head has its own copy of the embedding on the last stage under pipelining.
    params = sum(la.weight_params + la.bias_params + la.replicated_params for la in layers)
    return float(params * per_param)


def block_costs(spec: ModelSpec) -> BlockCosts:
    """Group ``spec`` into blocks, head and tail. ValueError if no layer names a block index."""
    blocks: dict[int, list[LayerSpec]] = {}
    head: list[LayerSpec] = []
    tail: list[LayerSpec] = []
    for layer in spec.layers:
        found = _BLOCK.search(layer.name)
        if found is not None:
            blocks.setdefault(int(found.group(1)), []).append(layer)
        else:
            (tail if blocks else head).append(layer)
    if not blocks:
        raise ValueError(f"model: no repeated blocks (names like h.0.*) in {spec.name}")
    first = blocks[min(blocks)]
    dtype = spec.dtype_bytes
    activations = sum(
        la.tokens * (la.in_features * la.saves_input + la.out_features * la.saves_output)
        for la in first
    )
    return BlockCosts(
        num_blocks=len(blocks),
        block_flops=_flops(first),
        head_flops=_flops(head),
        tail_flops=_flops(tail),
        block_state_bytes=_state(first, spec.state_bytes_per_param),
        head_state_bytes=_state(head, spec.state_bytes_per_param),
        tail_state_bytes=_state(tail, spec.state_bytes_per_param),
        block_activation_bytes=float(activations * dtype),
        message_bytes=float(first[0].tokens * first[0].in_features * dtype),
        block_layers=len(first),
    )


@dataclass(frozen=True, slots=True)
class StagePlan:
    """The pipeline decisions of a plan and their predicted step times."""

    layers_per_stage: tuple[int, ...]
    """Transformer blocks per stage, first to last (``parallel.num_layers_per_stage``)."""
    stage_flops: tuple[float, ...]
    """FLOP/s of each stage (its tensor-parallel devices together)."""
    num_microbatches: int
    k: int
    step_s: float
    """Predicted seconds per step: this split, ``num_microbatches``, kFkB with ``k``."""
    even_layers: tuple[int, ...]
    """Colossal-AI's even split of the same blocks."""
    even_step_s: float
    """Predicted seconds per step of the even split with 1F1B and the same micro-batches."""
    configured: tuple[str, ...] = ()
    """Which of ``layers``, ``microbatches``, ``k`` the config fixed (the rest are planned)."""
    measured_stage_s: tuple[float, float] | tuple[()] = ()
    """With measured stage times (``plan.stage_times``): the slowest stage's measured seconds
    per micro-batch on this split and on the even one; empty when split from the model."""


def _costs(
    costs: BlockCosts, layers: list[int], flops: list[float], room: list[float], link: list[float]
) -> PipelineCosts:
    p = len(layers)
    work = [n * costs.block_flops for n in layers]
    work[0] += costs.head_flops
    work[-1] += costs.tail_flops
    return PipelineCosts(
        forward_s_per_sample=tuple(w / f for w, f in zip(work, flops, strict=True)),
        backward_s_per_sample=tuple(2 * w / f for w, f in zip(work, flops, strict=True)),
        activation_bytes_per_sample=tuple(n * costs.block_activation_bytes for n in layers),
        memory_budget_bytes=tuple(
            max(0.0, room[s] - layers[s] * costs.block_state_bytes) for s in range(p)
        ),
        link_s_per_sample=tuple(costs.message_bytes / bw for bw in link),
    )


def plan_stages(
    spec: ModelSpec,
    cluster: ClusterSpec,
    pp: int,
    tp: int,
    pipeline_batch: int,
    *,
    balance_ends: bool = True,
    layers_per_stage: Sequence[int] = (),
    num_microbatches: int = 0,
    k: int = 0,
    stage_times: StageTimes | None = None,
) -> StagePlan:
    """Layers per stage, micro-batches and ``k`` for ``pp`` stages of ``tp`` devices each (any
    data-parallel replicas: ``cluster`` lists ``pp * tp * dp`` devices in Colossal-AI's dp-outer
    order), training ``pipeline_batch`` samples per step in each pipeline.

    ``balance_ends``: count the first stage's embeddings and the last stage's head when
    balancing (a large vocabulary's head costs several blocks). False balances the blocks
    alone, as Colossal-AI's even split does (equal devices get exactly it). The predicted
    times count the ends either way.

    ``layers_per_stage`` / ``num_microbatches`` / ``k``: keep these as given (a configured
    split, count or group size; ``k = 1`` for 1F1B) and plan only the rest; empty / 0: plan.

    ``stage_times``: measured seconds per micro-batch of each stage (``plan.stage_times``):
    the split balances them (``split_from_times``, same memory caps), not the modelled FLOP/s;
    micro-batches, ``k`` and the predicted steps still come from the model. Raises
    ValueError when the blocks or their activations cannot fit the stages' memory.
    """
    costs = block_costs(spec)
    flops, room, link = _stage_resources(costs, cluster, pp, tp)
    # Fixed per-layer work (Python, launches; probed on the fastest device): not scaled by speed.
    overhead = cluster.layer_overhead_flops / max(cluster.speeds)

    def choose(layers: list[int]) -> MicrobatchChoice:
        split = _costs(costs, layers, flops, room, link)
        return choose_microbatches(split, pipeline_batch, num_microbatches=num_microbatches, k=k)

    given = list(layers_per_stage) or _measured_split(costs, stage_times, room)
    layers = given or _split(costs, flops, room, balance_ends, 1, 0.0)
    choice = choose(layers)
    if overhead > 0 and not given:  # per micro-batch: needs its size, so resplit
        size = pipeline_batch // choice.num_microbatches
        layers = _split(costs, flops, room, balance_ends, size, overhead)
        choice = choose(layers)
    even, m = even_split(costs.num_blocks, pp), choice.num_microbatches
    even_costs = _costs(costs, even, flops, room, link)
    return StagePlan(
        layers_per_stage=tuple(layers),
        stage_flops=tuple(flops),
        num_microbatches=m,
        k=choice.decision.k,
        step_s=choice.decision.predicted_step_s,
        even_layers=tuple(even),
        even_step_s=_one_f_one_b_step(even_costs, pipeline_batch, m),
        configured=_configured(layers_per_stage, num_microbatches, k),
        measured_stage_s=_slowest(None if layers_per_stage else stage_times, layers, even),
    )


def _stage_resources(
    costs: BlockCosts, cluster: ClusterSpec, pp: int, tp: int
) -> tuple[list[float], list[float], list[float]]:
    """Each stage's FLOP/s, bytes of room for block states (its ends' states taken) and each
    boundary's bandwidth."""
    dp = cluster.num_devices // (pp * tp)
    flops = stage_speeds(cluster.speeds, pp, tp, dp)
    room = stage_speeds(cluster.memory_bytes, pp, tp, dp)  # the same sum-then-min rule
    room[0] -= costs.head_state_bytes
    room[-1] -= costs.tail_state_bytes
    return flops, room, boundary_bandwidths(cluster.bandwidths, pp, tp, dp)


def _slowest(
    times: StageTimes | None, layers: list[int], even: list[int]
) -> tuple[float, float] | tuple[()]:
    """The slowest stage's measured seconds on ``layers`` and on ``even`` (none: ``()``)."""
    if times is None:
        return ()
    return max(times.stage_seconds(layers)), max(times.stage_seconds(even))


def _measured_split(costs: BlockCosts, times: StageTimes | None, room: list[float]) -> list[int]:
    """The blocks over the stages balancing measured ``times`` (``split_from_times``), no stage
    holding more blocks than ``room`` bytes of states allow; ``[]`` without times."""
    if times is None:
        return []
    if len(times.block_s) != len(room):
        raise ValueError(f"stage_times: {len(times.block_s)} stages for pp {len(room)}")
    return split_from_times(
        costs.num_blocks, times, memory_bytes=room, layer_bytes=costs.block_state_bytes
    )


def _configured(layers: Sequence[int], m: int, k: int) -> tuple[str, ...]:
    pairs = (("layers", bool(layers)), ("microbatches", m > 0), ("k", k > 0))
    return tuple(name for name, fixed in pairs if fixed)


def _split(
    costs: BlockCosts,
    flops: list[float],
    room: list[float],
    ends: bool,
    microbatch: int,
    overhead_s: float,
) -> list[int]:
    """The blocks over stages of ``flops`` with ``room`` bytes for states, balancing each
    stage's affine time per micro-batch of ``microbatch`` samples (``stages.StageTimes``): a
    block costs its forward and backward FLOPs at the stage's rate plus ``overhead_s`` per
    layer whatever the rate (``ends``: the embeddings and head count on the first and last
    stage). With no overhead the micro-batch size only scales every time."""
    work = microbatch * (1.0 + BACKWARD_FLOPS_FACTOR)
    block = affine_block_seconds(costs.block_layers * overhead_s, work * costs.block_flops, flops)
    fixed = [0.0] * len(flops)
    if ends:
        fixed[0] += work * costs.head_flops / flops[0]
        fixed[-1] += work * costs.tail_flops / flops[-1]
    return split_from_times(
        costs.num_blocks,
        StageTimes(block, tuple(fixed)),
        memory_bytes=room,
        layer_bytes=costs.block_state_bytes,
    )


def boundary_bandwidths(bandwidths: Sequence[float], pp: int, tp: int, dp: int) -> list[float]:
    """Each stage boundary's bandwidth: the slowest device link on either side of it, over its
    pipeline columns (ranks in Colossal-AI's dp-outer order, as :func:`stage_speeds`)."""
    return [
        min(
            bandwidths[(d * pp + s + e) * tp + t]
            for d in range(dp)
            for t in range(tp)
            for e in (0, 1)
        )
        for s in range(pp - 1)
    ]


def _one_f_one_b_step(costs: PipelineCosts, pipeline_batch: int, m: int) -> float:
    """Predicted 1F1B step of ``costs`` with ``m`` micro-batches; inf when it does not fit."""
    try:
        return choose_k(costs.profile(pipeline_batch // m), m, candidates=[1]).predicted_step_s
    except ValueError:  # the activations of one micro-batch do not fit the memory
        return math.inf


def _ratio(plan: StagePlan) -> str:
    """The even split's predicted step over the plan's; a plan for micro-batches of no sample
    (a batch smaller than the configured count: no workload known) predicts nothing."""
    return f"{plan.even_step_s / plan.step_s:.2f}x" if plan.step_s > 0 else "no prediction"


def format_stage_plan(plan: StagePlan) -> str:
    """A few lines for ``colossal-hetero plan``."""
    speeds = ", ".join(f"{f / 1e12:.3g}" for f in plan.stage_flops)

    def how(name: str) -> str:
        return "   (configured)" if name in plan.configured else ""

    lines = [
        "pipeline stages (planned):",
        f"  stage TFLOP/s         {speeds}",
        f"  layers per stage      {list(plan.layers_per_stage)}"
        f"   (even: {list(plan.even_layers)}){how('layers')}",
    ]
    if plan.measured_stage_s:
        mine, even = plan.measured_stage_s
        lines.append(
            f"  split from            plan.stage_times: slowest stage {mine * 1e3:.3g} ms"
            f" per micro-batch (even split: {even * 1e3:.3g} ms)"
        )
    # With measured stage times only the split follows them; the step is still the model's.
    modelled = " (modelled speeds)" if plan.measured_stage_s else ""
    return "\n".join(
        [
            *lines,
            f"  micro-batches         {plan.num_microbatches}{how('microbatches')}",
            f"  kFkB group size k     {plan.k}{how('k')}",
            f"  predicted step        {plan.step_s * 1e3:.3g} ms{modelled}"
            f"   (even split, 1F1B: {plan.even_step_s * 1e3:.3g} ms, {_ratio(plan)})",
        ]
    )
