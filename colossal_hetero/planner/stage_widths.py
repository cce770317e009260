"""Uneven tensor-parallel widths inside each pipeline stage. Pure.

Under pipeline parallelism every stage has a tensor-parallel group of its own devices, so each
stage plans its own widths: HAP's search (:func:`~colossal_hetero.planner.loop.search_plan`)
over the layers the stage holds (its blocks, plus the embeddings on the first stage and the
final norm and LM head on the last, as Colossal-AI's pipeline policies place them) on the
stage's tensor-parallel devices (per TP rank the slowest data-parallel replica: replicas move
in lockstep), training the pipeline's share of the batch in ``num_microbatches`` passes. A rank
shards its layers with its own stage's widths; every rank can compute every stage's plan, so no
collective is needed. The vocabulary is the exception: every stage takes the last stage's
vocabulary widths, since a tied embedding's two copies (first and last stage) are synchronised
shard by shard.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from colossal_hetero.planner.plan import Plan
from colossal_hetero.planner.spec import ClusterSpec, LayerSpec, ModelSpec

_BLOCK = re.compile(r"\.(\d+)\.")


def stage_spec(spec: ModelSpec, layers_per_stage: Sequence[int], stage: int, dp: int) -> ModelSpec:
    """The part of ``spec`` that pipeline ``stage`` holds, with one pipeline's batch
    (``spec.batch_size // dp``). ValueError if the split does not cover the spec's blocks."""
    blocks: dict[int, list[LayerSpec]] = {}
    head: list[LayerSpec] = []
    tail: list[LayerSpec] = []
    for layer in spec.layers:
        found = _BLOCK.search(layer.name)
        if found is not None:
            blocks.setdefault(int(found.group(1)), []).append(layer)
        else:
            (tail if blocks else head).append(layer)
    order = sorted(blocks)
    if sum(layers_per_stage) != len(order) or not 0 <= stage < len(layers_per_stage):
        raise ValueError(
            f"parallel.num_layers_per_stage: {list(layers_per_stage)} does not split the "
            f"{len(order)} blocks of {spec.name}"
        )
    first = sum(layers_per_stage[:stage])
    held = [la for i in order[first : first + layers_per_stage[stage]] for la in blocks[i]]
    if stage == 0:
        held = head + held
    if stage == len(layers_per_stage) - 1:
        # Apart from the embedding, a tied LM head keeps its own copy of the weights (Colossal-AI
        # syncs the two copies' gradients across the stages): here it owns them.
        held = held + [replace(la, tied=False) if stage > 0 else la for la in tail]
    return replace(spec, layers=tuple(held), batch_size=max(1, spec.batch_size // dp))


def stage_cluster(cluster: ClusterSpec, pp: int, tp: int, stage: int) -> ClusterSpec:
    """The ``tp`` devices of ``stage``'s tensor-parallel group (Colossal-AI's dp-outer rank
    order ``(d * pp + s) * tp + t``); per TP rank the slowest data-parallel replica's speed, and
    the least memory and bandwidth of them."""
    dp = cluster.num_devices // (pp * tp)
    ranks = [[(d * pp + stage) * tp + t for d in range(dp)] for t in range(tp)]
    return replace(
        cluster,
        speeds=tuple(min(cluster.speeds[r] for r in rs) for rs in ranks),
        memory_bytes=tuple(min(cluster.memory_bytes[r] for r in rs) for rs in ranks),
        bandwidths=tuple(min(cluster.bandwidths[r] for r in rs) for rs in ranks),
    )


def plan_stage_widths(
    spec: ModelSpec,
    cluster: ClusterSpec,
    pp: int,
    tp: int,
    layers_per_stage: Sequence[int],
    num_microbatches: int = 1,
    **search: Any,
) -> list[Plan]:
    """One tensor-parallel plan per pipeline stage (its ``widths`` are what that stage's ranks
    shard with); ``search``: ``search_plan``'s keyword arguments (alignment, max_iters, space).

    A stage's step is ``num_microbatches`` forward and backward passes of its layers, and each
    pass pays every layer's fixed cost (``cluster.layer_overhead_flops``, framework and launch
    work whatever the shard): the search charges it that many times per step. The FLOPs are
    the pipeline's batch either way. A slower device pays the fixed cost slower too, so the
    more micro-batches, the more width leaves it.

    Raises ValueError (naming the layer or device) when a stage's devices cannot hold it.
    """
    from colossal_hetero.planner.loop import search_plan

    if num_microbatches < 1:
        raise ValueError(f"num_microbatches: must be >= 1, got {num_microbatches}")
    dp = cluster.num_devices // (pp * tp)
    per_step = cluster.layer_overhead_flops * num_microbatches
    cluster = replace(cluster, layer_overhead_flops=per_step)
    plans = [
        search_plan(
            stage_cluster(cluster, pp, tp, s),
            stage_spec(spec, layers_per_stage, s, dp),
            tp_size=tp,
            **search,
        )
        for s in range(pp)
    ]
    # A tied embedding and LM head are one weight whose two copies (first and last stage)
    # Colossal-AI keeps in sync by all-reducing their shards: every stage shards the
    # vocabulary alike, as the last stage planned it (its head is the vocabulary's real work).
    vocab = plans[-1].widths.get("vocab")
    if vocab is None:
        return plans
    return [replace(plan, widths={**plan.widths, "vocab": vocab}) for plan in plans]
