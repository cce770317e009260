"""The plan's gradient sync at runtime: which modules sync by SFB, and whether the layout can.

The plan marks layers ``grad_sync: sfb`` (``LayerPlan.modules`` names their modules). SFB
(:mod:`colossal_hetero.comm.sfb`) replaces torch DDP's all-reduce for those parameters, so it
runs only where Colossal-AI wraps the model in DDP (dp > 1, zero_stage 0, pp 1), and on whole
modules (tp 1). The planner plans it only there (``Space.MEGATRON_SFB``); a plan that asks for it
elsewhere is refused here, on every rank alike, before any collective.
"""

from __future__ import annotations

from torch import nn

from colossal_hetero.comm.primitives import Method
from colossal_hetero.comm.sfb import SfbHandle, exclude_from_ddp, install_sfb, sfb_param_names
from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.schema import ParallelConfig
from colossal_hetero.planner.plan import Plan


def planned_sfb(plan: Plan | None, parallel: ParallelConfig, dp_size: int) -> dict[str, Method]:
    """Module name -> how its factors are gathered, for the plan's SFB layers.

    Empty without a plan, without SFB layers, or with one data-parallel rank (nothing to sync).

    Raises:
        ConfigError: the plan has SFB layers but the layout does not run torch DDP on whole
            modules (tp > 1, pp > 1 or zero_stage > 0).
    """
    layers = [] if plan is None else [la for la in plan.layers if la.grad_sync == "sfb"]
    if not layers or dp_size == 1:
        return {}
    if parallel.tp > 1 or parallel.pp > 1 or parallel.zero_stage > 0:
        raise ConfigError(
            f"plan: layer {layers[0].name} syncs gradients by sfb, which needs torch DDP over "
            f"whole modules (tp 1, pp 1, zero_stage 0); the run has tp {parallel.tp}, pp "
            f"{parallel.pp}, zero_stage {parallel.zero_stage} (plan with space megatron)"
        )
    methods: dict[str, Method] = {}
    for layer in layers:
        method: Method = "grouped" if layer.collective == "grouped" else "padded"
        methods.update(dict.fromkeys(layer.modules, method))
    return methods


def exclude_sfb_from_ddp(model: nn.Module, methods: dict[str, Method]) -> None:
    """Before the engine wraps ``model``: keep DDP off the SFB modules' parameters.

    Raises:
        ConfigError: a planned module is missing from ``model`` or is not linear.
    """
    if not methods:
        return
    try:
        exclude_from_ddp(model, sfb_param_names(model, methods))
    except ValueError as error:
        raise ConfigError(f"plan: {error}") from None


def install_planned_sfb(boosted: nn.Module, methods: dict[str, Method]) -> SfbHandle | None:
    """After boosting: SFB hooks on the modules of ``boosted`` (a HybridParallelModule) over
    the data-parallel group its DDP uses; None when nothing syncs by SFB."""
    if not methods:
        return None
    inner = boosted.unwrap()
    return install_sfb(inner, methods, group=boosted.dp_group)
