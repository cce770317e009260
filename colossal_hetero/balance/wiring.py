"""Build the balancer controller from a configured plugin: wiring only, no algorithm.

The plugin (a composition root) calls :func:`build_balancer` at the end of ``configure``
and adds the result to its step seam.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist

from colossal_hetero.balance.actuator import LayerOps
from colossal_hetero.balance.checks import IN_LAYER_MODES
from colossal_hetero.balance.controller import (
    Actuator,
    BalanceController,
    Widths,
)
from colossal_hetero.balance.detector import width_key_compute
from colossal_hetero.balance.replan import plan_widths
from colossal_hetero.layers import layout_of
from colossal_hetero.metrics.decisions import DecisionWriter
from colossal_hetero.planner.resolve import calibrated, needs_calibration


def build_balancer(
    plugin: Any,
    model: Any,
    optimizer: Any,
    metrics_dir: str | Path | None,
    layer_ops: Callable[[Any], Any] = LayerOps,
) -> BalanceController:
    """The controller of ``plugin.config.balancer`` for the booster's ``model``/``optimizer``.

    With replan or semi at ``parallel.pp`` 1 and no ``plan.reference_tflops`` the device model
    is measured again (``utils.probe.probe_world``, one world all_reduce), as the plugin's own
    planning did, for the re-planner. With pp > 1 there is no re-planner (semi picks among the
    in-layer actions) and each pipeline stage agrees on its own rows. Decisions go to
    ``balance_rank{r}.jsonl`` in ``metrics_dir`` (in memory only when None). With resize,
    migrate or semi, ``layer_ops`` (``LayerOps``, or the plugin's choice with its interface:
    2D SUMMA layers' ``tp2d.resize.LayerOps2D``, whose ``apply``/``refresh`` gather priority
    scores over the mesh, so every rank calls them at the same step) gets the unwrapped
    model's resizable layers and, with ``balancer.freeze_dropped``, wraps the optimizer's
    inner ``step`` to freeze the dropped columns.
    """
    config, tp_group = plugin.config, plugin.engine.tp_group
    settings, world = config.balancer, dist.get_world_size()
    replans = settings.mode in ("replan", "semi") and plugin.pp_size == 1  # pp > 1: in-layer only
    if replans and needs_calibration(config):
        from colossal_hetero.utils.probe import probe_world

        config = calibrated(config, probe_world(plugin.device))
    plan, hf_model = plugin.plan, model.unwrap()
    workload = (plan.batch_size, plan.seq_len) if plan is not None else plugin.workload

    def current() -> Widths:
        widths = getattr(plugin.engine.custom_policy, "widths", None) or {}
        return {key: tuple(counts) for key, counts in widths.items()}

    ops = layer_ops(hf_model) if settings.mode in IN_LAYER_MODES else None
    if ops is not None and settings.freeze_dropped and optimizer is not None:
        ops.install_freeze(optimizer)
    actuator = Actuator(
        widths=current,
        plan=partial(plan_widths, config, hf_model, world, workload) if replans else None,
        resize=lambda widths: plugin.resize(model, optimizer, widths),
        ops=ops,
        compute=key_compute(hf_model, workload, world // plugin.tp_size),
    )
    weight_bytes = sum(
        p.numel() * p.element_size() for p in hf_model.parameters() if layout_of(p) is not None
    )
    return BalanceController(
        settings,
        tp_size=plugin.tp_size,
        tp_rank=dist.get_rank(tp_group),
        group_index=min(dist.get_process_group_ranks(tp_group)),
        stage=plugin.stage_manager.stage if plugin.pp_size > 1 else 0,
        planned_for=declared_speeds(config.cluster.speeds(world), plugin.tp_size),
        weight_bytes=float(weight_bytes),
        actuator=actuator,
        device=plugin.device,
        log=DecisionWriter(metrics_dir, "balance", plugin.rank),
    )


def declared_speeds(speeds: list[float], tp_size: int) -> tuple[float, ...]:
    """Per tensor-parallel position (device ``d`` at ``d % tp``), its slowest declared
    device's speed relative to the fastest device."""
    fastest = max(speeds)
    return tuple(
        min(s for d, s in enumerate(speeds) if d % tp_size == p) / fastest for p in range(tp_size)
    )


def key_compute(
    model: Any, workload: tuple[int, int] | None, dp_size: int
) -> dict[str, float] | None:
    """Per width key, the forward FLOPs per sample of the layers it sizes, read from the
    model's dimensions by the planner's transformers reader at the planned sequence length
    (the planner's default workload when None); None for a model it cannot read (every
    width key then weighs the same)."""
    from colossal_hetero.planner.hf import model_spec_from_hf

    hf_config = getattr(model, "config", None)
    seq_len = workload[1] if workload else getattr(hf_config, "max_position_embeddings", 512)
    try:
        spec = model_spec_from_hf(hf_config, 8 * dp_size, seq_len)
    except (ValueError, AttributeError, TypeError):
        return None
    return (
        width_key_compute(
            (layer.kind.value, layer.flops_per_token * layer.tokens) for layer in spec.layers
        )
        or None
    )
