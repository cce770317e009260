"""The plugin's planning at ``configure``: calibrate, plan, announce, and record what runs.

Wiring only: the measurements are utils/probe.py's, the plan the planner's (planner/resolve.py),
the table planner/plan.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.schema import HeteroConfig
from colossal_hetero.planner.plan import Plan, dump_plan, format_plan_summary, with_widths
from colossal_hetero.planner.resolve import (
    calibrated,
    needs_calibration,
    plan_for_model,
    stage_plan_for_model,
    stage_widths_for_model,
    wants_plan,
    wants_planned_schedule,
    wants_stage_plan,
    wants_stage_widths,
)
from colossal_hetero.planner.stage_plan import StagePlan, even_split, format_stage_plan
from colossal_hetero.utils.probe import probe_world


def plan_at_configure(
    config: HeteroConfig,
    model: Any,
    world_size: int,
    device: torch.device,
    workload: tuple[int, int] | None,
    dataloader: Any = None,
) -> Plan | None:
    """The plan the plugin makes for ``model``, or None when the config wants none.

    With ``plan.mode: auto`` and no ``plan.reference_tflops``, every rank first measures the
    device model (``utils.probe.probe_world``: one all_reduce over the world group agrees the
    numbers, so every rank plans the same). ``workload`` defaults to what ``dataloader``
    tells without drawing a batch (``workload_of``), else to plan_for_model's default. Call
    on every rank.
    """
    if not wants_plan(config):
        return None
    if needs_calibration(config):
        config = calibrated(config, probe_world(device))
    dp = world_size // (config.parallel.tp * config.parallel.pp)
    if workload is None and dataloader is not None:
        workload = workload_of(dataloader, dp)
    return plan_for_model(config, model, world_size, workload)


def plan_stages_at_configure(
    config: HeteroConfig,
    model: Any,
    world_size: int,
    workload: tuple[int, int] | None,
    stage_manager: Any,
    rank: int,
    scheduler: Any = None,
    dataloader: Any = None,
) -> StagePlan | None:
    """Plan the pipeline stages for ``model`` and set them on Colossal-AI's ``stage_manager``
    (its ``num_layers_per_stage``, which the shardformer policy reads when it shards), or None
    when the config keeps the stages as they are (``wants_stage_plan``) and fixes the
    micro-batch count and ``k``. A planned count (``parallel.num_microbatches: 0``) and ``k``
    (``parallel.pp_k: 0``) are set on ``scheduler`` (Colossal-AI's 1F1B or ``KFKBSchedule``);
    the count needs the batch size: ``workload`` or ``dataloader`` (``workload_of``). Rank 0
    prints the plan. Pure planning, no collective: every rank computes the same plan. Call
    before the engine shards the model and before the first step.
    """
    if not (wants_stage_plan(config) or wants_planned_schedule(config)):
        return None
    parallel = config.parallel
    dp = world_size // (parallel.tp * parallel.pp)
    if workload is None and dataloader is not None:
        workload = workload_of(dataloader, dp)
    if workload is None and parallel.num_microbatches == 0:
        raise ConfigError(
            "parallel.num_microbatches: 0 (planned) needs the batch size: pass workload= to "
            "the plugin or a dataloader to boost, or set the count"
        )
    plan = stage_plan_for_model(config, model, world_size, workload)
    if wants_stage_plan(config):
        stage_manager.num_layers_per_stage = list(plan.layers_per_stage)
    if scheduler is not None and parallel.num_microbatches == 0:
        scheduler.num_microbatches = plan.num_microbatches
    if scheduler is not None and parallel.pp_k == 0 and hasattr(scheduler, "set_k"):
        scheduler.set_k(plan.k)  # KFKBSchedule (kfkb, ada_kfkb's first k)
    if rank == 0:
        print(format_stage_plan(plan))
    return plan


def stage_widths_at_configure(
    config: HeteroConfig,
    model: Any,
    world_size: int,
    workload: tuple[int, int] | None,
    stage_manager: Any,
    dataloader: Any = None,
    num_microbatches: int = 0,
) -> dict[str, tuple[int, ...]]:
    """This rank's pipeline stage's planned tensor-parallel widths (``planner.stage_widths``:
    each stage plans its own layers on its own TP devices), or ``{}`` (even widths) unless
    ``wants_stage_widths``. Uses the stage split already on ``stage_manager`` (planned or
    configured; else Colossal-AI's even one) and a step of ``num_microbatches`` passes (0: the
    configured count). Pure planning, no collective: call on every rank, after
    ``plan_stages_at_configure`` and before the engine shards the model."""
    if not wants_stage_widths(config):
        return {}
    parallel = config.parallel
    dp = world_size // (parallel.tp * parallel.pp)
    if workload is None and dataloader is not None:
        workload = workload_of(dataloader, dp)
    split = list(getattr(stage_manager, "num_layers_per_stage", None) or [])
    split = split or even_split(model.config.num_hidden_layers, parallel.pp)
    plans = stage_widths_for_model(config, model, world_size, workload, split, num_microbatches)
    return dict(plans[stage_manager.stage].widths)


def plan_pipeline_at_configure(
    plugin: Any, model: Any, dataloader: Any = None
) -> tuple[StagePlan | None, dict[str, tuple[int, ...]]]:
    """``plan_stages_at_configure`` then ``stage_widths_at_configure`` for a
    ``HeteroParallelPlugin``'s config, layout and schedule: (stage plan or None, this stage's
    TP widths or ``{}``).

    With ``plan.mode: auto`` and no ``plan.reference_tflops``, both plan on the device model
    every rank measures first (``utils.probe.probe_world``, one all_reduce over the world), as
    the tensor-parallel planner does (``plan_at_configure``); the planner's GPU-class default
    would price compute as nearly free beside the links."""
    config = plugin.config
    scheduler = getattr(plugin.engine, "scheduler", None)
    planned = wants_stage_plan(config) or wants_planned_schedule(config)
    if (planned or wants_stage_widths(config)) and needs_calibration(config):
        config = calibrated(config, probe_world(plugin.device))
    stage_plan = plan_stages_at_configure(
        config,
        model,
        plugin.world_size,
        plugin.workload,
        plugin.stage_manager,
        plugin.rank,
        scheduler=scheduler,
        dataloader=dataloader,
    )
    # Each micro-batch pays every layer's fixed cost: the widths need the count that runs.
    passes = getattr(scheduler, "num_microbatches", None) or config.parallel.num_microbatches
    widths = stage_widths_at_configure(
        config,
        model,
        plugin.world_size,
        plugin.workload,
        plugin.stage_manager,
        dataloader,
        num_microbatches=passes or 0,
    )
    return stage_plan, widths


def workload_of(dataloader: Any, dp_size: int) -> tuple[int, int] | None:
    """``(global batch, seq_len)`` from a per-rank dataloader, without drawing a batch.

    The global batch is the loader's ``batch_size`` times the data-parallel size; the length
    is the first sample's ``input_ids`` (a dict sample) or first tensor's last dimension.
    None when either is unknown (an iterable dataset, a batch sampler, no such field):
    reading a batch would advance the loader's shuffling and change the data order.
    """
    batch_size = getattr(dataloader, "batch_size", None)
    dataset = getattr(dataloader, "dataset", None)
    if not batch_size or dataset is None or not hasattr(dataset, "__getitem__"):
        return None
    try:
        sample = dataset[0]
    except Exception:  # any dataset may refuse indexing; the default workload then applies
        return None
    if isinstance(sample, dict):
        sample = sample.get("input_ids")
    elif isinstance(sample, tuple | list):
        sample = sample[0] if sample else None
    if not isinstance(sample, torch.Tensor) or sample.dim() == 0:
        return None
    return batch_size * dp_size, int(sample.shape[-1])


def plan_that_runs(plan: Plan | None, policy: Any, tp_size: int) -> tuple[Plan | None, str]:
    """The plan describing what a user ``policy=`` runs, and a note when it changed.

    A resizable policy's resolved widths are recorded in the plan; any other policy shards
    evenly, so a plan with uneven widths no longer describes the run and becomes None.
    """
    from colossal_hetero.policies import ResizablePolicy

    if plan is None or policy is None or tp_size == 1:
        return plan, ""
    if isinstance(policy, ResizablePolicy):
        if all(plan.widths.get(k) == tuple(v) for k, v in policy.widths.items()):
            return plan, ""
        note = f"policy= overrides the plan's widths: running {dict(policy.widths)}"
        return with_widths(plan, dict(policy.widths)), note
    note = "policy= is not resizable: its even split runs, so plugin.plan is None"
    return None, note


def announce(plan: Plan | None, note: str, rank: int, run_dir: Path | None = None) -> None:
    """On rank 0: print the plan's short table (and ``note``), and write the plan to
    ``run_dir/plan.yaml`` when there is a run folder; quiet elsewhere."""
    if rank != 0:
        return
    if note:
        print(f"colossal-hetero: {note}")
    if plan is not None:
        print(format_plan_summary(plan))
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            dump_plan(plan, run_dir / "plan.yaml")


def plan_2d_at_configure(
    config: HeteroConfig,
    model: Any,
    tp_group: Any,
    world_size: int,
    workload: tuple[int, int] | None,
    dataloader: Any,
    rank: int,
    run_dir: Path | None = None,
) -> Any:
    """The planner's ``Tp2dPlan`` for a ``tp_mode: 2d`` run on unequal devices, or None.

    None (even blocks) unless ``plan.mode`` is auto and the listed devices differ. GPT-2, Llama
    (heads in whole key/value groups) and ViT (its classes split over the columns) are planned
    (``planner.tp2d_plan.dims_2d``; another model gets the conversion's ValueError). The batch
    per data-parallel group comes from ``workload`` or ``dataloader`` (``workload_of``);
    unknown, the rows stay even. Collective over the world (one all_gather_object learns every
    TP group; the plan is then the same pure computation on
    every rank). Rank 0 prints the plan and writes ``run_dir/plan_2d.json``.
    """
    from colossal_hetero.planner.resolve import is_heterogeneous
    from colossal_hetero.planner.tp2d_plan import dims_2d, plan_tp2d
    from colossal_hetero.tp2d.mesh import tp_rank_lists

    hf: Any = getattr(model, "config", None)
    if config.plan.mode != "auto" or not is_heterogeneous(config.cluster):
        return None
    if getattr(hf, "model_type", None) not in ("gpt2", "llama", "vit"):
        return None  # convert_to_2d names the unsupported model
    lists = tp_rank_lists(tp_group)
    dp = world_size // config.parallel.tp
    if workload is None and dataloader is not None:
        workload = workload_of(dataloader, dp)
    batch = workload[0] // dp if workload is not None else None
    speeds = config.cluster.speeds(world_size)
    heads, ffn, vocab, head_unit = dims_2d(hf)
    plan = plan_tp2d(speeds, lists, batch, heads, ffn, vocab, head_unit=head_unit)
    if rank == 0:
        print(f"colossal-hetero: {plan.summary()}")
        if run_dir is not None:
            import json

            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "plan_2d.json").write_text(json.dumps(plan.to_dict(), indent=1) + "\n")
    return plan
