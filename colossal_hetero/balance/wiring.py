"""Build the balancer controller from a configured plugin: wiring only, no algorithm.

The plugin (a composition root) calls :func:`build_balancer` at the end of ``configure``
and adds the result to its step seam.
"""

from __future__ import annotations

from collections.abc import Callable
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

    With replan or semi and no ``plan.reference_tflops`` the device model is measured once
    more here (``utils.probe.probe_world``: one all_reduce over the world, on every rank),
    as the plugin's own planning did, so that the re-planner plans with the same figures.
    Decisions go to ``balance_rank{r}.jsonl`` in ``metrics_dir`` (kept in memory only when
    None). With resize, migrate or semi the in-layer actuator (balance/actuator.py) gets the
    model's resizable layers and, with ``balancer.freeze_dropped``, wraps the optimizer's
    inner ``step`` to freeze the dropped columns. ``layer_ops`` builds that actuator from the
    unwrapped model: ``LayerOps``, or the plugin's choice with LayerOps' interface (2D SUMMA
    layers: ``tp2d.resize.LayerOps2D``, whose ``apply``/``refresh`` gather priority scores over
    the mesh, so every rank calls them at the same step, as the controller does).
    """
    config = plugin.config
    settings = config.balancer
    tp_group = plugin.engine.tp_group
    world = dist.get_world_size()
    if settings.mode in ("replan", "semi") and needs_calibration(config):
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
        plan=lambda speeds: plan_widths(config, hf_model, world, workload, speeds),
        resize=lambda widths: plugin.resize(model, optimizer, widths),
        ops=ops,
        compute=key_compute(hf_model, workload, world // plugin.tp_size),
    )
    weight_bytes = sum(
        p.numel() * p.element_size() for p in hf_model.parameters() if layout_of(p) is not None
    )
    log = DecisionWriter(metrics_dir, "balance", plugin.rank)
    return BalanceController(
        settings,
        tp_size=plugin.tp_size,
        tp_rank=dist.get_rank(tp_group),
        group_index=min(dist.get_process_group_ranks(tp_group)),
        planned_for=declared_speeds(config.cluster.speeds(world), plugin.tp_size),
        weight_bytes=float(weight_bytes),
        actuator=actuator,
        device=plugin.device,
        log=log,
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
