"""Pipeline stages for unequal devices: layers per stage, micro-batch count and kFkB ``k``. Pure.

``split_layers`` gives each stage a number of (equal) layers so that the slowest stage is as fast
as it can be: stage ``s`` takes ``n_s * layer_seconds / speed_s + extra_seconds[s]`` per pass
and may hold at most as many layers as its memory allows. Equal devices get Colossal-AI's own even
split (``PipelineStageManager.distribute_layers``: the remainder goes to a run of middle stages),
so enabling the planner on a homogeneous cluster changes nothing.

``choose_microbatches`` picks the micro-batch count (and ``k`` for it) from the pipeline
simulator, trading fewer pipeline bubbles against per-pass overhead and activation memory.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from colossal_hetero.pipeline.tuner import KDecision, PipelineProfile, choose_k, fits_memory


def remainder_priority(num_stages: int) -> list[int]:
    """Stages in the order Colossal-AI hands out the remainder of an even split.

    ``distribute_layers`` gives ``r`` extra layers to stages ``p//2 - r//2 .. p//2 - r//2 + r - 1``;
    those runs are nested as ``r`` grows, so they define one order of stages.
    """
    order: list[int] = []
    for r in range(1, num_stages + 1):
        start = num_stages // 2 - r // 2
        order += [s for s in range(start, start + r) if s not in order]
    return order


def _caps(
    p: int,
    num_layers: int,
    memory_bytes: Sequence[float] | None,
    layer_bytes: float,
    extra_bytes: Sequence[float],
) -> list[int]:
    if memory_bytes is None or layer_bytes <= 0:
        return [num_layers] * p
    if len(memory_bytes) != p:
        raise ValueError(f"memory_bytes: {len(memory_bytes)} values for {p} stages")
    pairs = zip(memory_bytes, extra_bytes, strict=True)
    return [max(0, math.floor((m - e) / layer_bytes)) for m, e in pairs]


def split_layers(
    num_layers: int,
    speeds: Sequence[float],
    *,
    layer_seconds: float = 1.0,
    extra_seconds: Sequence[float] | None = None,
    memory_bytes: Sequence[float] | None = None,
    layer_bytes: float = 0.0,
    extra_bytes: Sequence[float] | None = None,
) -> list[int]:
    """Layers per stage (``len(speeds)`` stages, each >= 1) minimising the slowest stage's time.

    ``speeds[s]`` is stage ``s``'s relative speed, ``extra_seconds[s]`` the time of its fixed
    work (embedding, LM head). A stage holds at most ``(memory_bytes[s] - extra_bytes[s]) //
    layer_bytes`` layers. Greedy water-filling: each layer goes to the stage whose time grows
    least, ties to Colossal-AI's remainder order; it takes the ``num_layers`` cheapest layer
    slots, so its maximum is optimal. Raises ValueError when the layers cannot fit.
    """
    p = len(speeds)
    if p < 1 or any(not (math.isfinite(v) and v > 0) for v in speeds):
        raise ValueError(f"speeds: need one finite speed > 0 per stage, got {list(speeds)}")
    if num_layers < p:
        raise ValueError(f"num_layers: {num_layers} layers cannot fill {p} pipeline stages")
    extra_t = [0.0] * p if extra_seconds is None else list(extra_seconds)
    extra_b = [0.0] * p if extra_bytes is None else list(extra_bytes)
    if len(extra_t) != p or len(extra_b) != p:
        raise ValueError("extra_seconds, extra_bytes: need one value per stage")
    caps = _caps(p, num_layers, memory_bytes, layer_bytes, extra_b)
    if min(caps) < 1 or sum(caps) < num_layers:
        raise ValueError(
            f"memory_bytes: stages hold at most {caps} layers, the model has {num_layers}"
        )
    rank = {s: i for i, s in enumerate(remainder_priority(p))}

    def time_with(s: int, n: int) -> float:
        return n * layer_seconds / speeds[s] + extra_t[s]

    layers = [1] * p
    heap = [(time_with(s, 2), rank[s], s) for s in range(p) if caps[s] > 1]
    heapq.heapify(heap)
    for _ in range(num_layers - p):
        _, _, s = heapq.heappop(heap)
        layers[s] += 1
        if layers[s] < caps[s]:
            heapq.heappush(heap, (time_with(s, layers[s] + 1), rank[s], s))
    return layers


@dataclass(frozen=True, slots=True)
class StageTimes:
    """Measured seconds of one micro-batch's forward + backward on each pipeline stage.

    ``block_s[s]``: one transformer block on stage ``s``'s devices, at their speed;
    ``fixed_s[s]``: the rest of that stage's pass, the same whatever its block count
    (embeddings, LM head and loss, the schedule's Python, per-pass launches). A stage with
    ``n`` blocks then takes ``fixed_s[s] + n * block_s[s]`` (an affine model in ``n``).
    """

    block_s: tuple[float, ...]
    fixed_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.block_s) != len(self.fixed_s) or not self.block_s:
            raise ValueError("stage times: need one block and one fixed time per stage")
        if any(not (math.isfinite(b) and b > 0) for b in self.block_s):
            raise ValueError(f"stage times: block seconds must be > 0, got {self.block_s}")
        if any(not (math.isfinite(f) and f >= 0) for f in self.fixed_s):
            raise ValueError(f"stage times: fixed seconds must be >= 0, got {self.fixed_s}")

    def stage_seconds(self, layers: Sequence[int]) -> list[float]:
        """Each stage's predicted seconds per micro-batch with ``layers`` blocks."""
        pairs = zip(layers, self.block_s, self.fixed_s, strict=True)
        return [f + n * b for n, b, f in pairs]


def affine_block_seconds(
    fixed_s: float, compute_s: float, speeds: Sequence[float]
) -> tuple[float, ...]:
    """Per stage, one block's seconds when ``fixed_s`` of it does not scale with the device
    (Python, autograd, collectives' latency) and ``compute_s`` (at speed 1) does."""
    if fixed_s < 0 or compute_s < 0 or any(v <= 0 for v in speeds):
        raise ValueError("affine block time: need fixed_s, compute_s >= 0 and speeds > 0")
    return tuple(fixed_s + compute_s / v for v in speeds)


def split_from_times(
    num_layers: int,
    times: StageTimes,
    *,
    memory_bytes: Sequence[float] | None = None,
    layer_bytes: float = 0.0,
    extra_bytes: Sequence[float] | None = None,
    slack: float = 0.0,
) -> list[int]:
    """Layers per stage minimising the slowest stage's measured time (``times``), within the
    same memory caps and with the same tie rule as :func:`split_layers` (equal times give
    Colossal-AI's even split). A stage's block time plays the inverse of its speed.

    ``slack``: the splits whose slowest stage is within ``1 + slack`` of the best cannot be
    told apart by the measurement; take the one nearest Colossal-AI's even split (fewest
    blocks moved: every stage keeps its even share unless that exceeds the limit, the blocks
    that leaves go where the stage time grows least).
    """
    best = split_layers(
        num_layers,
        [1.0 / b for b in times.block_s],
        layer_seconds=1.0,
        extra_seconds=times.fixed_s,
        memory_bytes=memory_bytes,
        layer_bytes=layer_bytes,
        extra_bytes=extra_bytes,
    )
    if not slack > 0:
        return best
    p = len(best)
    limit = max(times.stage_seconds(best)) * (1.0 + slack) * (1.0 + 1e-12)
    extra_b = [0.0] * p if extra_bytes is None else list(extra_bytes)
    mem = _caps(p, num_layers, memory_bytes, layer_bytes, extra_b)
    caps = [
        max(n, min(c, math.floor((limit - f) / b)))  # n: the best split stays allowed
        for n, c, b, f in zip(best, mem, times.block_s, times.fixed_s, strict=True)
    ]
    layers = [min(e, c) for e, c in zip(even_split(num_layers, p), caps, strict=True)]
    rank = {s: i for i, s in enumerate(remainder_priority(p))}

    def grown(s: int) -> tuple[float, int, int]:
        return (times.fixed_s[s] + (layers[s] + 1) * times.block_s[s], rank[s], s)

    heap = [grown(s) for s in range(p) if layers[s] < caps[s]]
    heapq.heapify(heap)
    for _ in range(num_layers - sum(layers)):
        _, _, s = heapq.heappop(heap)
        layers[s] += 1
        if layers[s] < caps[s]:
            heapq.heappush(heap, grown(s))
    return layers


def near_best_splits(
    num_layers: int, times: StageTimes, *, slack: float, limit: int
) -> list[list[int]]:
    """Every split (each stage >= 1 block) whose slowest stage is within ``1 + slack`` of the
    best one's under ``times``, at most ``limit`` of them: fastest predicted first, ties
    broken by fewer blocks moved from Colossal-AI's even split, then lexicographically.
    The first is a best split. For a measurement that cannot tell near-ties apart: the
    caller times them (``bench pipeline`` runs each for a few steps)."""
    if slack < 0 or limit < 1:
        raise ValueError(f"near_best_splits: need slack >= 0 and limit >= 1, got {slack}, {limit}")
    p = len(times.block_s)
    best = split_layers(num_layers, [1.0 / b for b in times.block_s], extra_seconds=times.fixed_s)
    bound = max(times.stage_seconds(best)) * (1.0 + slack) * (1.0 + 1e-12)
    even = even_split(num_layers, p)
    found: list[tuple[float, int, list[int]]] = []

    def extend(prefix: list[int], left: int) -> None:
        s = len(prefix)
        if s == p - 1:
            split = [*prefix, left]
            if times.fixed_s[s] + left * times.block_s[s] <= bound:
                moved = sum(abs(a - b) for a, b in zip(split, even, strict=True)) // 2
                found.append((max(times.stage_seconds(split)), moved, split))
            return
        most = min(left - (p - 1 - s), math.floor((bound - times.fixed_s[s]) / times.block_s[s]))
        for n in range(1, most + 1):
            extend([*prefix, n], left - n)

    extend([], num_layers)
    found.sort(key=lambda item: (item[0], item[1], item[2]))
    return [split for _, _, split in found[:limit]]


def even_split(num_layers: int, pp: int) -> list[int]:
    """Colossal-AI's even split (``PipelineStageManager.distribute_layers``)."""
    layers = [num_layers // pp] * pp
    for s in remainder_priority(pp)[: num_layers % pp]:
        layers[s] += 1
    return layers


def stage_speeds(device_speeds: Sequence[float], pp: int, tp: int, dp: int) -> list[float]:
    """Speed of each pipeline stage from per-rank speeds in Colossal-AI's dp-outer layout.

    Rank ``(d * pp + s) * tp + t`` is data-parallel replica ``d``, stage ``s``, TP rank ``t``.
    A stage's TP ranks share its layers by planned (uneven) widths, so they add up; its
    data-parallel replicas move in lockstep, so the slowest replica counts.
    """
    if len(device_speeds) != pp * tp * dp:
        raise ValueError(
            f"cluster.speeds: {len(device_speeds)} devices for pp*tp*dp={pp * tp * dp}"
        )
    return [
        min(sum(device_speeds[(d * pp + s) * tp + t] for t in range(tp)) for d in range(dp))
        for s in range(pp)
    ]


@dataclass(frozen=True, slots=True)
class PipelineCosts:
    """Per-sample costs of one step's pipeline passes, from the cost model or a profile."""

    forward_s_per_sample: tuple[float, ...]
    backward_s_per_sample: tuple[float, ...]
    activation_bytes_per_sample: tuple[float, ...]
    memory_budget_bytes: tuple[float, ...]
    """Bytes each stage may spend on in-flight activations."""
    link_s_per_sample: tuple[float, ...]
    """Seconds one sample's activation holds boundary ``b``'s link (bytes / bandwidth)."""
    latency_s: tuple[float, ...] = ()
    pass_overhead_s: float = 0.0
    """Fixed seconds per forward or backward pass (kernel launches, Python), any size."""

    def profile(self, microbatch_size: int) -> PipelineProfile:
        """The tuner's profile for micro-batches of ``microbatch_size`` samples."""
        n, o = microbatch_size, self.pass_overhead_s
        return PipelineProfile(
            forward_s=tuple(n * f + o for f in self.forward_s_per_sample),
            backward_s=tuple(n * b + o for b in self.backward_s_per_sample),
            transfer_s=tuple(n * c for c in self.link_s_per_sample),
            activation_bytes=tuple(n * a for a in self.activation_bytes_per_sample),
            memory_budget_bytes=self.memory_budget_bytes,
            latency_s=self.latency_s,
        )


@dataclass(frozen=True, slots=True)
class MicrobatchChoice:
    num_microbatches: int
    decision: KDecision
    step_s_by_microbatches: dict[int, float] = field(repr=False)


def choose_microbatches(
    costs: PipelineCosts, global_batch_size: int, *, num_microbatches: int = 0, k: int = 0
) -> MicrobatchChoice:
    """Micro-batch count ``m`` (a divisor of the batch, ``m >= p`` as Colossal-AI's 1F1B requires)
    and ``k`` with the least simulated step time whose activations fit; ties to the smaller ``m``.

    ``num_microbatches`` / ``k``: fixed values (the config's), 0 to choose them. A fixed ``k``
    limits ``m`` to ``m >= k``; ``k = 1`` is 1F1B's step.
    """
    p = len(costs.forward_s_per_sample)
    if num_microbatches:
        candidates = [num_microbatches]
    else:
        low = max(p, k)
        candidates = [m for m in range(low, global_batch_size + 1) if global_batch_size % m == 0]
    decisions: dict[int, KDecision] = {}
    for m in candidates:
        prof = costs.profile(global_batch_size // m)
        if fits_memory(prof, m, k or 1):  # 1F1B holds the fewest micro-batches of any k
            decisions[m] = choose_k(prof, m, candidates=[k] if k else None)
    if not decisions:
        raise ValueError(
            f"data.global_batch_size: no micro-batch count of {global_batch_size} samples "
            f"(>= {max(p, k)} micro-batches) fits the stage memory budgets"
        )
    times = {m: d.predicted_step_s for m, d in decisions.items()}
    best = min(times.values())
    m = min(c for c, t in times.items() if t <= best * (1 + 1e-9))
    return MicrobatchChoice(m, decisions[m], times)


def split_candidates(
    num_layers: int,
    times: StageTimes,
    first: Sequence[int] | None = None,
    *,
    slack: float = 0.12,
    limit: int = 3,
) -> list[list[int]]:
    """``first`` (e.g. the split the plugin planned from ``times``), then the fastest other
    splits ``times`` predict within ``1 + slack`` of the best (:func:`near_best_splits`): at most
    ``limit`` in all."""
    near = near_best_splits(num_layers, times, slack=slack, limit=limit)
    head = [list(first)] if first else []
    return (head + [s for s in near if s not in head])[:limit]
