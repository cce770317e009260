"""The balancer's layout checks, raised on every rank before any collective. Pure.

Field-local checks (ranges) live in ``config.schema.BalancerConfig``;
these need the rest of the config. The plugin calls :func:`check_balancer` at construction.
"""

from __future__ import annotations

from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.schema import HeteroConfig

MOVING_MODES = ("replan", "semi")
"""Modes that may resize the widths."""
IN_LAYER_MODES = ("resize", "migrate", "semi")
"""Modes that attach in-layer ops to the resizable layers."""


def check_balancer(config: HeteroConfig) -> None:
    """ConfigError (one line naming ``balancer.mode``) unless the layout can run the mode.

    Any mode but none balances inside tensor-parallel groups, so needs ``parallel.tp > 1``.
    resize and migrate act inside the layers of each tensor-parallel group and run under any
    data- and pipeline-parallel layout (each pipeline stage decides for its own groups).
    replan moves widths through ``plugin.resize`` and re-runs the planner, so it also needs
    ``parallel.pp == 1`` (the planner does not re-plan pipeline stages). replan, and semi
    (which may re-plan with pp 1; with pp > 1 it picks among none, resize, migrate and
    migrate+resize only), need ``parallel.zero_stage == 0`` (resize does not move ZeRO
    partitions) and ``plan.model_spec: hf`` (the re-plan reads the transformers config of
    the sharded model; an fx trace of it would see the shards). Under ``parallel.tp_mode``
    2d only detect and resize (ZERO-resizing inside the SUMMA steps).
    """
    balancer, parallel = config.balancer, config.parallel
    mode = balancer.mode
    if mode == "none":
        return
    if parallel.tp < 2:
        raise ConfigError(
            f"balancer.mode: {mode} balances inside tensor-parallel groups and needs "
            f"parallel.tp > 1, got {parallel.tp}"
        )
    if parallel.tp_mode == "2d" and mode not in ("detect", "resize"):
        raise ConfigError(
            f"balancer.mode: {mode} is not available with parallel.tp_mode 2d, whose SUMMA "
            "layers have ZERO-resizing but no migration or width re-planning; use detect or resize"
        )
    if mode not in MOVING_MODES:
        return
    if parallel.pp > 1 and mode == "replan":
        raise ConfigError(
            f"balancer.mode: replan re-plans the widths, which the planner does not do with "
            f"pipeline stages (parallel.pp {parallel.pp}); use semi (in-layer actions only "
            "with pp > 1), resize, migrate, detect or parallel.pp 1"
        )
    if parallel.zero_stage > 0:
        raise ConfigError(
            f"balancer.mode: {mode} resizes the shards, which ZeRO's flat partitions do not "
            f"allow (parallel.zero_stage {parallel.zero_stage}); use zero_stage 0 or detect"
        )
    if config.plan.model_spec != "hf":
        raise ConfigError(
            f"balancer.mode: {mode} re-plans from the transformers config; plan.model_spec "
            f"{config.plan.model_spec} is not supported (use hf)"
        )


def needs_resizable(config: HeteroConfig) -> bool:
    """Whether the balancer may resize or attach in-layer ops, so the model needs resizable
    layers even unplanned."""
    mode = config.balancer.mode
    return (mode in MOVING_MODES or mode in IN_LAYER_MODES) and config.parallel.tp > 1
