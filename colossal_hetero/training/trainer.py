"""The training loop behind ``python -m colossal_hetero.train``: wiring, not algorithms.

Per step and rank it writes one JSONL record (step time, compute time, communication wait,
loss); rank 0 shows a progress bar and, at the end, plots loss and per-rank step times.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from colossalai.booster import Booster

from colossal_hetero.config.loader import dump_config
from colossal_hetero.config.schema import RunConfig
from colossal_hetero.data import build_data, shard_batch_by_shares, share_loss_scale
from colossal_hetero.emulation.shaped.controller import STEP_DIR_ENV, report_step
from colossal_hetero.metrics import (
    MetricsWriter,
    StepRecord,
    TrainingProgress,
    plot_run,
    rank_metrics_path,
    read_run,
)
from colossal_hetero.models import build_model, loss_from_outputs
from colossal_hetero.planner.batch_shares import batch_shares
from colossal_hetero.planner.plan import Plan, dump_plan
from colossal_hetero.plugin import HeteroParallelPlugin
from colossal_hetero.plugin.seam import step_record
from colossal_hetero.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from colossal_hetero.training.optim import build_lr_scheduler, build_optimizer
from colossal_hetero.training.steps import evaluate, to_device, train_step
from colossal_hetero.utils.device import is_host_device


@dataclass(frozen=True, slots=True)
class RunResult:
    """What a finished run reports (identical on every rank)."""

    final_step: int
    val_losses: list[tuple[int, float]]
    val_accuracy: float | None


def run_training(config: RunConfig, device: torch.device, plan: Plan | None = None) -> RunResult:
    """Train as ``config`` says on an initialised process group; returns the validation curve.

    ``plan`` (from ``planner.resolve.resolve_plan``) sets uneven tensor-parallel widths and
    data-parallel shares; None trains Colossal-AI's even layout.
    """
    if is_host_device(device):
        torch.set_num_threads(1)  # ranks share the host's cores; one thread each
    rank = dist.get_rank()
    workload = (config.data.global_batch_size, config.data.seq_len)
    # The plugin writes the plan and its controllers' decisions beside the trainer's own
    # step records (richer than the seam's: learning rate, validation).
    plugin = HeteroParallelPlugin(
        config.plugin_config(),
        plan=plan,
        workload=workload,
        metrics_dir=config.logging.dir,
        step_metrics=False,
    )
    try:
        return _train(config, device, plugin, rank)
    finally:
        plugin.close()


@dataclass(slots=True)
class _Boosted:
    """What ``Booster.boost`` returned, kept together for the loop."""

    booster: Booster
    model: Any
    optimizer: Any
    criterion: Any
    lr_scheduler: Any


@dataclass(frozen=True, slots=True)
class _RankData:
    """This rank's view of the data: its batch share, loss scale and validation batches."""

    shares: list[int]
    dp_rank: int
    loss_scale: float
    val_batches: list[Any]


def _train(
    config: RunConfig, device: torch.device, plugin: HeteroParallelPlugin, rank: int
) -> RunResult:
    out_dir = Path(config.logging.dir)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(dump_config(config))
    boosted = _boost(config, plugin)
    start_step = _maybe_resume(
        config, boosted.booster, boosted.model, boosted.optimizer, boosted.lr_scheduler
    )
    if rank == 0 and plugin.plan is not None:
        dump_plan(plugin.plan, out_dir / "plan.yaml")  # the layout this run trained with
    data = build_data(config.data, config.model.arch)
    rank_data = _rank_data(config, plugin, data, rank, device)
    batches = data.train_batches(config.data.global_batch_size, config.data.seed, start_step)
    dist.barrier()
    val_losses, accuracy = _loop(config, device, plugin, boosted, rank_data, batches, start_step)
    dist.barrier()
    if rank == 0 and config.logging.plot:
        plot_run(read_run(out_dir), out_dir / "plot.png", title=_title(config))
    return RunResult(final_step=config.train.steps, val_losses=val_losses, val_accuracy=accuracy)


def _boost(config: RunConfig, plugin: HeteroParallelPlugin) -> _Boosted:
    model = build_model(config.model)
    optimizer = build_optimizer(model, config.optimizer)
    lr_scheduler = build_lr_scheduler(optimizer, config.optimizer, config.train.steps)
    booster = Booster(plugin=plugin)
    model, optimizer, criterion, _, lr_scheduler = booster.boost(
        model, optimizer, loss_from_outputs, lr_scheduler=lr_scheduler
    )
    return _Boosted(booster, model, optimizer, criterion, lr_scheduler)


def _rank_data(
    config: RunConfig, plugin: HeteroParallelPlugin, data: Any, rank: int, device: torch.device
) -> _RankData:
    """Batch shares from the plan (or the config), and this data-parallel rank's part."""
    dp_rank = rank // (plugin.tp_size * plugin.pp_size)  # dp is the outermost mesh axis
    if plugin.plan is not None and not config.parallel.batch_shares:
        shares = list(plugin.plan.group_samples)
    else:
        shares = batch_shares(
            config.plugin_config(), plugin.world_size, plugin.dp_size, config.data.global_batch_size
        )
    val_batches = [
        to_device(shard_batch_by_shares(b, shares, dp_rank), device)
        for b in data.val_batches(config.data.global_batch_size, config.train.eval_batches)
    ]
    return _RankData(shares, dp_rank, share_loss_scale(shares, dp_rank), val_batches)


def _loop(
    config: RunConfig,
    device: torch.device,
    plugin: HeteroParallelPlugin,
    boosted: _Boosted,
    rank_data: _RankData,
    batches: Any,
    start_step: int,
) -> tuple[list[tuple[int, float]], float | None]:
    """Run steps ``start_step..train.steps-1``; returns the validation curve and last accuracy."""
    rank = dist.get_rank()
    out_dir = Path(config.logging.dir)
    val_losses: list[tuple[int, float]] = []
    accuracy: float | None = None
    with (
        MetricsWriter(rank_metrics_path(out_dir, rank)) as writer,
        TrainingProgress(
            config.train.steps, enabled=config.logging.progress and rank == 0, start_step=start_step
        ) as bar,
    ):
        step_dir = os.environ.get(STEP_DIR_ENV)  # set by the shaped launcher
        for step in range(start_step, config.train.steps):
            if step_dir:  # the launcher's controller applies step-scheduled preemptions
                report_step(step_dir, rank, step)
            batch = next(batches)
            record = _one_step(config, device, plugin, boosted, rank_data, batch, step)
            if record.val_loss is not None:
                val_losses.append((step, record.val_loss))
                accuracy = record.val_accuracy
            writer.write(record)
            _show_progress(bar, record, rank_data.shares[rank_data.dp_rank], device)
            if record.val_loss is not None:
                bar.log(_val_line(record))
            if config.checkpoint.dir is not None and _is_checkpoint_step(config, step):
                save_checkpoint(
                    boosted.booster,
                    config.checkpoint.dir,
                    step + 1,
                    boosted.model,
                    boosted.optimizer,
                    boosted.lr_scheduler,
                )
    return val_losses, accuracy


def _one_step(
    config: RunConfig,
    device: torch.device,
    plugin: HeteroParallelPlugin,
    boosted: _Boosted,
    rank_data: _RankData,
    batch: Any,
    step: int,
) -> StepRecord:
    """One training step on the seam (and an evaluation when due); returns its record."""
    use_pipeline = plugin.pp_size > 1
    local = to_device(shard_batch_by_shares(batch, rank_data.shares, rank_data.dp_rank), device)
    plugin.seam.begin_step(step)  # explicit, so resumed runs keep their step numbers
    loss = train_step(
        boosted.booster,
        boosted.model,
        boosted.optimizer,
        boosted.criterion,
        local,
        use_pipeline=use_pipeline,
        loss_scale=rank_data.loss_scale,
    )
    timing = plugin.seam.end_step()  # closed by optimizer.step(); this fetches it
    boosted.lr_scheduler.step()
    record = step_record(timing, dist.get_rank(), loss, lr=boosted.lr_scheduler.get_last_lr()[0])
    if _is_eval_step(config, step):
        result = evaluate(
            boosted.booster,
            boosted.model,
            boosted.criterion,
            rank_data.val_batches,
            use_pipeline=use_pipeline,
            device=device,
        )
        record = replace(record, val_loss=result.loss, val_accuracy=result.accuracy)
    return record


def _show_progress(
    bar: TrainingProgress, record: StepRecord, num_samples: int, device: torch.device
) -> None:
    """Gather every rank's loss and step time to rank 0 for the progress bar.

    The shown loss is the sample-weighted mean over the ranks that compute one.
    Collective: one all_gather of 3 numbers over the world group, outside the timed step.
    """
    weight = float(num_samples) if record.loss is not None else 0.0
    mine = torch.tensor(
        [(record.loss or 0.0) * weight, weight, record.step_time],
        dtype=torch.float64,
        device=device,
    )
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    total_weight = sum(float(t[1]) for t in gathered)
    loss = sum(float(t[0]) for t in gathered) / total_weight if total_weight else None
    step_times = [float(t[2]) for t in gathered]
    bar.update(record.step, loss, max(step_times), step_times)


def _val_line(record: StepRecord) -> str:
    accuracy = f", accuracy {record.val_accuracy:.3f}" if record.val_accuracy is not None else ""
    return f"step {record.step + 1}: validation loss {record.val_loss:.4f}{accuracy}"


def _is_eval_step(config: RunConfig, step: int) -> bool:
    every = config.train.eval_every
    return every > 0 and ((step + 1) % every == 0 or step + 1 == config.train.steps)


def _is_checkpoint_step(config: RunConfig, step: int) -> bool:
    """Whether to save after ``step`` (the caller checks that checkpointing is on)."""
    checkpoint = config.checkpoint
    last = step + 1 == config.train.steps
    return last or (checkpoint.every > 0 and (step + 1) % checkpoint.every == 0)


def _maybe_resume(
    config: RunConfig, booster: Booster, model: Any, optimizer: Any, lr_scheduler: Any
) -> int:
    checkpoint = config.checkpoint
    if checkpoint.dir is None or not checkpoint.resume:
        return 0
    path = latest_checkpoint(checkpoint.dir)
    if path is None:
        return 0
    return load_checkpoint(booster, path, model, optimizer, lr_scheduler)


def _title(config: RunConfig) -> str:
    p = config.parallel
    slow = ", ".join(f"rank {s.rank} x{s.factor:g}" for s in config.emulation.slowdowns) or "none"
    return f"{config.model.arch}  tp={p.tp} pp={p.pp}  slowdowns: {slow}"
