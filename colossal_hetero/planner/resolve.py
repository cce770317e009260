"""Which plan a run uses: none (even split), one from a file, or one the planner makes now.

Pure and deterministic, so every rank resolves the same plan from the same YAML before any
collective starts; errors are ``ConfigError``s naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypedDict

from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.schema import ClusterConfig, HeteroConfig, PlanConfig, RunConfig
from colossal_hetero.planner.plan import Plan, load_plan
from colossal_hetero.planner.spec import REFERENCE_FLOPS, ModelSpec
from colossal_hetero.planner.stage_plan import StagePlan


def is_heterogeneous(cluster: ClusterConfig) -> bool:
    """Whether the listed devices differ in speed or memory."""
    devices = cluster.devices
    return len({d.speed for d in devices}) > 1 or len({d.memory_gib for d in devices}) > 1


def wants_plan(config: HeteroConfig) -> bool:
    """Whether this config runs with a planned (possibly uneven) layout."""
    mode = config.plan.mode
    if mode == "file":
        return True
    # Expert parallelism runs at tp = 1: no widths to plan (and the planner models no MoE);
    # its devices' speeds steer the expert placement instead (moe.replace_every).
    auto = is_heterogeneous(config.cluster) and config.parallel.pp == 1
    return mode == "auto" and auto and config.parallel.ep == 1


def needs_calibration(config: HeteroConfig) -> bool:
    """Whether the plugin must measure the device model before planning (auto mode and no
    ``plan.reference_tflops``): planning then waits for ``configure``."""
    return config.plan.mode == "auto" and config.plan.reference_tflops is None


def calibrated(config: HeteroConfig, probe: Any) -> HeteroConfig:
    """``config`` with the device model a probe measured (``utils.probe.WorldProbe``).

    The fastest rank's FLOP/s belongs to the fastest declared device, so speed 1.0 is
    ``probe.flops / max(speed)``; the per-layer overhead and latency are taken as measured,
    and no device's bandwidth may exceed the measured link. Pure: every rank that agreed on
    ``probe`` gets the same config.
    """
    devices = config.cluster.devices
    fastest = max((d.speed for d in devices), default=1.0)
    capped = [replace(d, bandwidth_gbps=min(d.bandwidth_gbps, probe.gbps)) for d in devices]
    plan = replace(
        config.plan,
        reference_tflops=probe.flops / fastest / 1e12,
        layer_overhead_us=probe.layer_overhead_s * 1e6,
        latency_us=probe.latency_s * 1e6,
    )
    return replace(config, plan=plan, cluster=replace(config.cluster, devices=capped))


def unplanned_notice(config: HeteroConfig) -> str | None:
    """What an ``auto`` run on a heterogeneous cluster leaves even, if anything."""
    if config.plan.mode == "auto" and is_heterogeneous(config.cluster) and config.parallel.pp > 1:
        stages = (
            "the stage split is parallel.num_layers_per_stage's"
            if config.parallel.num_layers_per_stage
            else "pipeline stages are planned"
        )
        widths = "planned per stage" if wants_stage_widths(config) else "even"
        return (
            f"plan.mode auto with parallel.pp = {config.parallel.pp}: {stages}; "
            f"tensor-parallel widths {widths}, batch shares even"
        )
    return None


def wants_stage_plan(config: HeteroConfig) -> bool:
    """Whether the run's pipeline stages are planned (pp > 1, ``plan.mode: auto``, unequal
    devices or measured ``plan.stage_times``, no explicit ``parallel.num_layers_per_stage``);
    else Colossal-AI's even split."""
    parallel, plan = config.parallel, config.plan
    auto = plan.mode == "auto" and (is_heterogeneous(config.cluster) or bool(plan.stage_times))
    return auto and parallel.pp > 1 and not parallel.num_layers_per_stage


def wants_planned_schedule(config: HeteroConfig) -> bool:
    """Whether the planner chooses the micro-batch count or ``k`` (pp > 1 and
    ``parallel.num_microbatches: 0``, or ``parallel.pp_k: 0`` under kfkb / ada_kfkb)."""
    parallel = config.parallel
    planned_k = parallel.pp_schedule != "1f1b" and parallel.pp_k == 0
    return parallel.pp > 1 and (parallel.num_microbatches == 0 or planned_k)


def stage_plan_for(config: HeteroConfig, spec: ModelSpec, world_size: int) -> StagePlan:
    """The pipeline stages for ``spec`` (its ``batch_size`` is the global batch) on the
    config's devices (``plan`` settings as for the tensor-parallel planner). What the config
    fixes stays: the split unless ``wants_stage_plan`` (else the configured or Colossal-AI's
    even one), a micro-batch count or ``pp_k`` other than 0, ``k = 1`` under 1f1b.

    Raises:
        ConfigError: the blocks or their activations do not fit the stages' memory.
    """
    from colossal_hetero.planner.spec import ClusterSpec
    from colossal_hetero.planner.stage_plan import block_costs, even_split, plan_stages

    parallel = config.parallel
    cluster = ClusterSpec.from_config(config.cluster, world_size, **_device_model(config.plan))
    dp = world_size // (parallel.tp * parallel.pp)
    split: list[int] = []
    k = 1 if parallel.pp_schedule == "1f1b" else parallel.pp_k
    try:
        if not wants_stage_plan(config):
            split = list(parallel.num_layers_per_stage)
            split = split or even_split(block_costs(spec).num_blocks, parallel.pp)
        return plan_stages(
            spec,
            cluster,
            parallel.pp,
            parallel.tp,
            spec.batch_size // dp,
            layers_per_stage=split,
            num_microbatches=parallel.num_microbatches,
            k=k,
            stage_times=_stage_times(config),
        )
    except ValueError as error:
        raise ConfigError(f"plan: infeasible pipeline stages: {error}") from None


def _stage_times(config: HeteroConfig) -> Any:
    """``plan.stage_times`` as the planner's ``StageTimes``, or None when not given."""
    from colossal_hetero.planner.stages import StageTimes

    times = config.plan.stage_times
    if not times:
        return None
    return StageTimes(tuple(t.block_s for t in times), tuple(t.fixed_s for t in times))


def wants_stage_widths(config: HeteroConfig) -> bool:
    """Whether each pipeline stage plans uneven tensor-parallel widths of its own (pp > 1,
    tp > 1, 1D tensor parallelism, ``plan.mode: auto``, unequal devices, no experts)."""
    parallel = config.parallel
    auto = config.plan.mode == "auto" and is_heterogeneous(config.cluster)
    one_d = parallel.tp_mode == "1d" and parallel.ep == 1
    return auto and one_d and parallel.pp > 1 and parallel.tp > 1


def stage_widths_for(
    config: HeteroConfig,
    spec: ModelSpec,
    world_size: int,
    layers_per_stage: list[int],
    num_microbatches: int = 0,
) -> list[Plan]:
    """Per pipeline stage, the tensor-parallel plan of its layers on its devices
    (``planner.stage_widths``; ``plan`` settings as for the tensor-parallel planner), for a
    step of ``num_microbatches`` passes (0: ``parallel.num_microbatches``, else 1).

    Raises:
        ConfigError: a stage's devices cannot hold its layers.
    """
    from colossal_hetero.planner.spec import ClusterSpec
    from colossal_hetero.planner.stage_widths import plan_stage_widths

    parallel, settings = config.parallel, config.plan
    cluster = ClusterSpec.from_config(config.cluster, world_size, **_device_model(settings))
    passes = num_microbatches or parallel.num_microbatches or 1
    try:
        return plan_stage_widths(
            spec,
            cluster,
            parallel.pp,
            parallel.tp,
            layers_per_stage,
            passes,
            alignment=settings.alignment,
            max_iters=settings.max_iters,
            space=_executed_space(config),
        )
    except ValueError as error:
        raise ConfigError(f"plan: infeasible tensor-parallel widths in a stage: {error}") from None


def stage_widths_for_model(
    config: HeteroConfig,
    model: Any,
    world_size: int,
    workload: tuple[int, int] | None,
    layers_per_stage: list[int],
    num_microbatches: int = 0,
) -> list[Plan]:
    """:func:`stage_widths_for` a transformers ``model`` (the plugin's path; ``workload`` as in
    :func:`plan_for_model`)."""
    dp = world_size // (config.parallel.tp * config.parallel.pp)
    hf_config = getattr(model, "config", None)
    batch_size, seq_len = workload or (8 * dp, getattr(hf_config, "max_position_embeddings", 512))
    spec = _model_spec(config.plan, model, batch_size, seq_len, _dtype_bytes(config))
    return stage_widths_for(config, spec, world_size, layers_per_stage, num_microbatches)


def stage_plan_for_model(
    config: HeteroConfig, model: Any, world_size: int, workload: tuple[int, int] | None
) -> StagePlan:
    """:func:`stage_plan_for` a transformers ``model`` (the plugin's path; ``workload`` as in
    :func:`plan_for_model`)."""
    dp = world_size // (config.parallel.tp * config.parallel.pp)
    hf_config = getattr(model, "config", None)
    batch_size, seq_len = workload or (8 * dp, getattr(hf_config, "max_position_embeddings", 512))
    spec = _model_spec(config.plan, model, batch_size, seq_len, _dtype_bytes(config))
    return stage_plan_for(config, spec, world_size)


def stage_plan_run(run: RunConfig, world_size: int) -> StagePlan:
    """:func:`stage_plan_for` the run's configured model, batch and sequence length (the
    ``plan`` command's path)."""
    from colossal_hetero.planner.loop import _run_model_spec

    config = run.plugin_config()
    return stage_plan_for(config, _run_model_spec(run, _dtype_bytes(config)), world_size)


def stage_widths_run(
    run: RunConfig, world_size: int, layers_per_stage: list[int], num_microbatches: int = 0
) -> list[Plan]:
    """:func:`stage_widths_for` the run's configured model, batch and sequence length."""
    from colossal_hetero.planner.loop import _run_model_spec

    config = run.plugin_config()
    spec = _run_model_spec(run, _dtype_bytes(config))
    return stage_widths_for(config, spec, world_size, layers_per_stage, num_microbatches)


def resolve_plan(run: RunConfig, world_size: int) -> Plan | None:
    """The plan for ``run`` on ``world_size`` ranks, or None for Colossal-AI's even split or
    when the plugin will plan at configure after measuring the devices (``needs_calibration``).

    Raises:
        ConfigError: the plan file is missing or does not match the layout, or the planner
            finds the layout infeasible (a device without memory for its shard, ...).
    """
    config = run.plugin_config()
    if not wants_plan(config):
        return None
    if needs_calibration(config):
        # The plugin measures the devices and plans at configure; plan here too, at the
        # default rate, so that an infeasible layout (memory, heads) is refused before any
        # collective: feasibility does not depend on the rate.
        plan_run(run, world_size)
        return None
    if config.plan.mode == "file":
        plan = _load(config.plan.path)
    else:
        plan = plan_run(run, world_size)
    check_plan(plan, config, world_size, run.data.global_batch_size)
    return plan


def plan_for_model(
    config: HeteroConfig, model: Any, world_size: int, workload: tuple[int, int] | None
) -> Plan:
    """Plan for a transformers ``model`` (the plugin's path when no plan was given).

    ``workload`` is ``(global_batch_size, seq_len)``; None means 8 samples per data-parallel
    group at the model's maximum sequence length. ``plan.model_spec`` picks how the model is
    read: "hf" from ``model.config``, "fx" from a torch.fx trace of ``model`` (traced on the
    meta device; the live weights are not touched).

    Raises:
        ConfigError: the plan file does not fit, the fx trace cannot be read as layers
            (``plan.model_spec``), or the planner finds the layout infeasible.
    """
    from colossal_hetero.planner.loop import search_plan
    from colossal_hetero.planner.spec import ClusterSpec

    if config.plan.mode == "file":
        plan = _load(config.plan.path)
        check_plan(plan, config, world_size, plan.batch_size)
        return plan
    dp = world_size // (config.parallel.tp * config.parallel.pp)  # the plugin checked the layout
    hf_config = getattr(model, "config", None)
    batch_size, seq_len = workload or (8 * dp, getattr(hf_config, "max_position_embeddings", 512))
    settings = config.plan
    cluster = ClusterSpec.from_config(
        config.cluster,
        world_size,
        **_device_model(settings),
    )
    spec = _model_spec(settings, model, batch_size, seq_len, _dtype_bytes(config))
    try:
        return search_plan(
            cluster,
            spec,
            tp_size=config.parallel.tp,
            alignment=settings.alignment,
            max_iters=settings.max_iters,
            space=_executed_space(config),  # what the resizable layers and DDP execute
        )
    except ValueError as error:
        raise ConfigError(f"plan: infeasible: {error}") from None


def _executed_space(config: HeteroConfig) -> Any:
    from colossal_hetero.planner.search import Space

    parallel = config.parallel
    return Space.executed(tp=parallel.tp, pp=parallel.pp, zero_stage=parallel.zero_stage)


def _model_spec(
    settings: PlanConfig, model: Any, batch_size: int, seq_len: int, dtype_bytes: int
) -> ModelSpec:
    if settings.model_spec == "hf":
        from colossal_hetero.planner.hf import model_spec_from_hf

        return model_spec_from_hf(model.config, batch_size, seq_len, dtype_bytes=dtype_bytes)
    from colossal_hetero.planner.fx import model_spec_from_fx

    try:
        return model_spec_from_fx(model, batch_size, seq_len, dtype_bytes=dtype_bytes)
    except ValueError as error:
        raise ConfigError(f"plan.model_spec: fx: {error}") from None


class _DeviceModel(TypedDict):
    reference_flops: float
    latency_s: float
    grouped_efficiency: float
    layer_overhead_s: float


def _device_model(settings: PlanConfig) -> _DeviceModel:
    """``ClusterSpec`` link and compute settings from the plan config, in SI units."""
    tflops = settings.reference_tflops
    return {
        # Unset (the plugin measures it at configure): the planner's GPU-class default.
        "reference_flops": REFERENCE_FLOPS if tflops is None else tflops * 1e12,
        "latency_s": settings.latency_us * 1e-6,
        "grouped_efficiency": settings.grouped_efficiency,
        "layer_overhead_s": settings.layer_overhead_us * 1e-6,
    }


def _dtype_bytes(config: HeteroConfig) -> int:
    return 4 if config.parallel.precision == "fp32" else 2


def check_plan(plan: Plan, config: HeteroConfig, world_size: int, batch_size: int) -> None:
    """Reject a plan made for another layout or batch size."""
    if plan.tp_size != config.parallel.tp or plan.num_devices != world_size:
        raise ConfigError(
            f"plan.path: the plan is for tp {plan.tp_size} x dp {plan.dp_size}, the run is "
            f"tp {config.parallel.tp} on {world_size} ranks"
        )
    if plan.batch_size != batch_size:
        raise ConfigError(
            f"plan.path: the plan is for a global batch of {plan.batch_size}, the run uses "
            f"data.global_batch_size {batch_size}"
        )
    executed = _executed_space(config)
    if plan.space not in ("megatron", executed.value):
        raise ConfigError(
            f"plan.path: the plan was searched in space {plan.space}, whose per-layer choices "
            f"this layout does not execute (it runs {executed.value}); make the plan with "
            "`colossal-hetero plan` for this config"
        )


def _load(path: Any) -> Plan:
    try:
        return load_plan(path)
    except FileNotFoundError:
        raise ConfigError(f"plan.path: no plan file at {path}") from None
    except (ValueError, KeyError) as error:
        raise ConfigError(f"plan.path: {path} is not a plan: {error}") from None


def plan_run(run: RunConfig, world_size: int) -> Plan:
    """Plan ``run`` now with its ``plan`` settings (also for identical devices).

    Raises:
        ConfigError: the planner finds the layout infeasible, naming what does not fit.
    """
    from colossal_hetero.planner.loop import plan_for_run

    settings = run.plan
    try:
        return plan_for_run(
            run,
            world_size,
            alignment=settings.alignment,
            max_iters=settings.max_iters,
            **_device_model(settings),
        )
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(f"plan: infeasible: {error}") from None


@dataclass(frozen=True)
class LayoutOption:
    """One tensor x data-parallel layout of the same ranks, as the planner predicts it."""

    tp: int
    dp: int
    step_time: float | None
    """Predicted seconds per step of the executed plan; None when the layout cannot run."""
    reason: str = ""
    """Why the layout cannot run (the error it would raise), when it cannot."""


def compare_layouts(
    run: RunConfig, world_size: int, check: Callable[[RunConfig, int], object] | None = None
) -> list[LayoutOption]:
    """The run's model, batch and devices planned for every ``tp x dp`` of ``world_size``
    ranks (pp 1), each in the space the plugin executes for it; by increasing tp.

    A layout that ``check`` (the run's validation, e.g. ``preflight.validate_run``: heads, batch
    divisibility) or the planner (heads, memory) rejects is listed with the reason instead of
    a time. ``check`` is passed in so that the planner does not import config validation.
    """
    options = []
    for tp in (t for t in range(1, world_size + 1) if world_size % t == 0):
        parallel = replace(run.parallel, tp=tp, pp=1, dp=0)
        layout = replace(run, parallel=parallel, plan=replace(run.plan, mode="auto"))
        try:
            if check is not None:
                check(layout, world_size)
            # Identical devices resolve to no plan: plan anyway for the predicted time.
            plan = resolve_plan(layout, world_size) or plan_run(layout, world_size)
        except (ConfigError, ValueError) as error:
            options.append(LayoutOption(tp, world_size // tp, None, str(error)))
            continue
        options.append(LayoutOption(tp, world_size // tp, plan.step_time))
    return options
