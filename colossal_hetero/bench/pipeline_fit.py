"""Phase (c)'s device model fitted to the probe run: a block pass's fixed and per-FLOP seconds.

Pure. The plugin plans a stage's tensor-parallel widths on a device model: a FLOP rate and a
fixed cost per layer and micro-batch pass (``plan.reference_tflops``, ``plan.layer_overhead_us``,
paid at each device's own speed). ``utils.probe.probe_world`` measures both away from the
model: a 384^3 matmul and an 8 x 8 linear. In place, on the bench's small GPT-2, a block's pass
costs far more per layer than that linear (Colossal-AI's shardformer layers, autograd, dozens
of ops on tiny tensors), so the planner, told the probe's figures, splits the slowed stage's
widths by speed alone, and the half-speed device keeps a third of a block whose time hardly
shrinks with its width.

The probe run (``pipeline_split.measure_stage_times``) holds what a better model needs: the
slowed stage's two TP ranks compute different widths on the same host, so each rank's thread
CPU seconds per block pass against its share of the block's FLOPs lie on one line; its
intercept is the fixed cost of a pass, its slope the seconds of a whole block's FLOPs. Both are
host seconds, as ``probe_world``'s figures are (the emulated devices stretch every second
alike). ``fit_device_model`` turns them into the ``probe_world`` fields the plugin plans on,
as a user writes measured figures into ``plan``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from colossal_hetero.planner.cost import BACKWARD_FLOPS_FACTOR
from colossal_hetero.planner.spec import LayerKind, ModelSpec

WIDTH_OF_KIND = {
    LayerKind.ATTENTION_QKV: "heads",
    LayerKind.ATTENTION_CORE: "heads",
    LayerKind.ATTENTION_OUT: "heads",
    LayerKind.MLP_UP: "ffn",
    LayerKind.MLP_DOWN: "ffn",
}
"""Which planned width shards each kind of a block's layers (the others are replicated)."""


def block_work(spec: ModelSpec) -> tuple[dict[str, float], int, int]:
    """The first transformer block's forward FLOPs per token by the width that shards them
    (``"heads"``, ``"ffn"``; ``"replicated"``: every rank computes them whole), how many of
    the planner's layers it holds (each pays the fixed cost once per pass) and its tokens per
    sample."""
    layers = [la for la in spec.layers if ".0." in la.name]
    assert layers, f"no block 0 in {spec.name}"
    work: dict[str, float] = {"heads": 0.0, "ffn": 0.0, "replicated": 0.0}
    for layer in layers:
        work[WIDTH_OF_KIND.get(layer.kind, "replicated")] += layer.flops_per_token
    return work, len(layers), layers[0].tokens


def rank_share(work: dict[str, float], widths: Mapping[str, Sequence[int]], index: int) -> float:
    """The fraction of a whole block's FLOPs that TP rank ``index`` computes with ``widths``
    (the stage's per-rank widths; a width key missing: even over the ranks)."""
    total = sum(work.values())
    share = work["replicated"]
    for key in ("heads", "ffn"):
        own = widths.get(key)
        if own is None:
            continue
        share += work[key] * own[index] / sum(own)
    return share / total


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``y = intercept + slope * x`` through ``points``: ``(intercept, slope)``,
    or None when the x values do not differ (nothing to fit) or the slope is not positive
    (noise larger than the width's effect: no rate to read)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread <= 1e-12:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    if slope <= 0:
        return None
    return mean_y - slope * mean_x, slope


def fit_device_model(
    measured: dict[str, float],
    spec: ModelSpec,
    microbatch: int,
    ranks: Sequence[tuple[Mapping[str, Sequence[int]], int, Mapping[str, float]]],
) -> dict[str, Any] | None:
    """``measured`` (``probe_world``'s fields) with the FLOP rate and fixed per-layer cost
    fitted to one stage's ranks, plus the fit, or None when the ranks' widths do not differ.

    ``ranks``: per TP rank of the stage, (the stage's widths, the rank's index in them, its
    ``Stretch`` totals over the probe: ``work_s``, the CPU seconds its emulated device was
    stretched by, and ``passes``). ``microbatch``: samples per
    micro-batch. A block's forward and backward on one micro-batch is two passes: its fixed
    cost is twice the intercept, shared by the block's layers; its FLOPs
    (``1 + BACKWARD_FLOPS_FACTOR`` times the forward's) take twice the slope at a full share.
    The intercept is kept >= 0 (a fixed cost is never negative)."""
    work, layers, tokens = block_work(spec)
    points = [
        (rank_share(work, widths, index), totals["work_s"] / totals["passes"])
        for widths, index, totals in ranks
    ]
    line = fit_line(points)
    if line is None:
        return None
    intercept, slope = max(0.0, line[0]), line[1]
    block_flops = (1.0 + BACKWARD_FLOPS_FACTOR) * sum(work.values()) * tokens * microbatch
    model = {
        **measured,
        "flops": block_flops / (2.0 * slope),
        "layer_overhead_s": 2.0 * intercept / layers,
    }
    fit = {"points": [list(p) for p in points], "pass_fixed_s": intercept, "pass_full_s": slope}
    return {"device_model": model, "fit": fit}
