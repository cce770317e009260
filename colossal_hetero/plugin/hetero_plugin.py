"""HeteroParallelPlugin: the booster plugin users pass to ``Booster``.

A composition root: it validates the config, prepares the device, builds its parts and wires
them together; no algorithm lives here. Parts and their seams:

- ``engine``: Colossal-AI's HybridParallelPlugin executing the layout (sharding, optimizer
  wrappers, pipeline schedule, checkpoint IO). Later parts replace its ``custom_policy``
  (resizable layers) and its ``scheduler`` (adaptive pipeline schedules).
- ``timer``: the collective interceptor that times communication for the per-rank metrics and,
  when configured, emulates slow devices and links. Several plugins may live in one process;
  their interceptors share one wrapper layer (emulation/router.py).
- ``seam``: the step boundaries (plugin/seam.py), found from the boosted model's training
  forwards and the boosted optimizer's ``step()``; the interceptor is its clock, and the
  metrics writer (``metrics_dir``) and runtime controllers are its clients.
- ``balancer``: with ``balancer.mode`` other than none, the straggler balancer
  (colossal_hetero/balance/) on the seam; it acts through ``resize``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from colossalai.booster.plugin.pp_plugin_base import PipelinePluginBase
from colossalai.checkpoint_io import CheckpointIO
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from colossal_hetero.balance.actuator import LayerOps
from colossal_hetero.balance.checks import check_balancer, needs_resizable
from colossal_hetero.balance.wiring import build_balancer
from colossal_hetero.checkpoint import HeteroCheckpointIO
from colossal_hetero.checkpoint.moe import MoeCheckpointIO
from colossal_hetero.compat.attention import keep_gpt2_causal
from colossal_hetero.compat.grad_norm import count_customized_shards_in_grad_norm
from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.schema import HeteroConfig
from colossal_hetero.emulation import CollectiveInterceptor, build_interceptor
from colossal_hetero.emulation.ddp import route_ddp_through_interceptor
from colossal_hetero.metrics.decisions import DecisionWriter
from colossal_hetero.moe.engine import MoeEngine, build_moe_engine
from colossal_hetero.moe.replace import build_replacer
from colossal_hetero.moe.wiring import MoeStepLog, install_reducers, moe_policy
from colossal_hetero.pipeline.seam_adapter import install_schedule
from colossal_hetero.pipeline.validate import check_stage_split
from colossal_hetero.planner.plan import Plan
from colossal_hetero.plugin.engine import build_engine
from colossal_hetero.plugin.grad_sync import exclude_sfb_from_ddp, install_planned_sfb, planned_sfb
from colossal_hetero.plugin.launch import prepare_device
from colossal_hetero.plugin.planning import (
    announce,
    plan_2d_at_configure,
    plan_at_configure,
    plan_pipeline_at_configure,
    plan_that_runs,
)
from colossal_hetero.plugin.resizing import resize_boosted
from colossal_hetero.plugin.seam import StepMetrics, StepSeam
from colossal_hetero.policies import ResizablePolicy, resizable_policy
from colossal_hetero.preflight import validate_layout
from colossal_hetero.tp2d.convert import convert_to_2d
from colossal_hetero.tp2d.policy import Converted2DPolicy
from colossal_hetero.tp2d.resize import LayerOps2D
from colossal_hetero.utils.collector import StepCollector
from colossal_hetero.utils.device import SUPPORTED_DEVICE_TYPES, backend_for, resolve_device
from colossal_hetero.utils.quiet import quiet_third_party_warnings


class HeteroParallelPlugin(PipelinePluginBase):
    """Booster plugin for heterogeneous clusters.

    Args:
        config: parallel layout, cluster description, emulation and planning settings.
        plan: a planner ``Plan`` (uneven tensor-parallel widths, data-parallel shares). When
            None and ``config.plan`` asks for one (mode auto on a heterogeneous cluster), the
            plugin plans at ``configure`` from the model's config and ``workload``.
        workload: ``(global_batch_size, seq_len)`` the plugin plans for when it plans itself;
            default: read from the dataloader given to ``boost`` (its batch size times dp, its
            first sample's length), else 8 samples per data-parallel group at the model's
            maximum length. With no ``plan.reference_tflops`` the plugin first measures the
            devices (plugin/planning.py). Rank 0 prints the plan's table.
        policy: optional shardformer ``Policy`` replacing the stock one (overrides the plan's;
            ``plan`` then records a resizable policy's widths, or is None for another policy).
        metrics_dir: a folder; when given, every step the seam closes appends one record to
            ``metrics_rank{r}.jsonl`` there (metrics/records.py). A plugin argument, not a
            config field: where a script's outputs go is the script's choice, and the trainer
            writes its own richer records (loss, lr, validation) under ``logging.dir``.
            Rank 0 also writes the plan there (``plan.yaml``) when the plugin has one, and
            the runtime controllers write their decision records there
            (``{balance,pipeline}_rank{r}.jsonl``, metrics/decisions.py).
        step_metrics: False keeps the seam from writing ``metrics_rank{r}.jsonl`` while
            ``metrics_dir`` still receives the plan and decisions (the trainer writes its own
            step records).

    Step boundaries are automatic (see plugin/seam.py): a plain Booster loop needs no timer
    calls for emulation, metrics and controllers to act per step.

    Raises:
        ConfigError: the layout does not fit the world size, or the device does not fit the
            process group's backend. Raised identically on every rank, before any collective.
        ValueError: another plugin in this process emulates a different cluster (the message
            names ``emulation.compute`` or ``emulation.network``); raised on every rank
            before this plugin creates any process group.
    """

    def __init__(
        self,
        config: HeteroConfig,
        *,
        plan: Plan | None = None,
        workload: tuple[int, int] | None = None,
        policy: Any = None,
        metrics_dir: str | Path | None = None,
        step_metrics: bool = True,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed (colossalai.launch*) first")
        self.config = config
        # Known third-party warnings (bitsandbytes, transformers, Colossal-AI) are dropped at
        # their source for a plain Booster script too, not only under our CLI and trainer.
        quiet_third_party_warnings(pipeline=config.parallel.pp > 1)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_size = validate_layout(config, self.world_size)
        check_balancer(config)  # before any collective, on every rank
        self.device = _device_for(config)
        prepare_device(self.device)
        count_customized_shards_in_grad_norm()  # clipping norm of TP shards (all devices)
        self.plan, self.workload, self._policy = plan, workload, policy
        self.plan_2d: Any = None  # tp_mode 2d on unequal devices: the planner's Tp2dPlan
        # Installed before the engine makes its process groups: a conflicting emulation of
        # another plugin in this process is refused first.
        self.timer: CollectiveInterceptor = build_interceptor(
            config.emulation, self.rank, self.world_size, self.device
        ).install()
        try:
            # parallel.ep > 1: Colossal-AI's MoE plugin (groups, optimizers), our reducers
            build = build_moe_engine if config.parallel.ep > 1 else build_engine
            self.engine = build(config, self.device, policy)
            # parallel.pp_schedule: kfkb / ada_kfkb replace the engine's 1F1B (gloo only)
            self.pipeline_control = install_schedule(self.engine, config, self.rank)
        except BaseException:
            self.timer.uninstall()
            raise
        self.seam = StepSeam(self.timer)
        self.balancer: Any = None  # the balance controller, wired at configure (balancer.mode)
        self.stage_plan: Any = None  # planned pipeline stages (StagePlan), set at configure
        self.stage_widths: dict[str, tuple[int, ...]] = {}  # this stage's planned TP widths
        self.moe_reducers: dict[str, Any] = {}  # parallel.ep > 1 without ZeRO, at configure
        self.moe_log: Any = None  # parallel.ep > 1: the a2a/chunk event log (MoeStepLog)
        self.moe_replacer: Any = None  # moe.replace_every > 0: speed-aware re-placement
        self._run_dir = None if metrics_dir is None else Path(metrics_dir)
        if metrics_dir is not None and step_metrics:
            self.seam.add(StepMetrics(self.seam, metrics_dir, self.rank))
        # gc.every: every rank collects garbage at the same step boundaries, none inside a step
        gc_every = config.gc.every
        self.collector = self.seam.add(StepCollector(gc_every)) if gc_every else None
        if self.pipeline_control is not None:  # ada_kfkb retunes k at step ends
            self.pipeline_control.log = DecisionWriter(metrics_dir, "pipeline", self.rank)
            self.seam.add(self.pipeline_control)

    def close(self) -> None:
        """Close the seam (metrics file) and detach the collective interceptor. The plugin
        must not be used afterwards."""
        self.seam.close()
        self.timer.uninstall()

    # -- layout -----------------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        """Tensor-parallel size."""
        return self.config.parallel.tp

    @property
    def pp_size(self) -> int:
        """Pipeline-parallel size."""
        return self.config.parallel.pp

    @property
    def stage_manager(self) -> Any:
        """Colossal-AI's pipeline stage manager (None without pipeline parallelism)."""
        return self.engine.stage_manager

    def is_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage (the one that sees the loss)."""
        return self.pp_size == 1 or self.engine.stage_manager.is_last_stage()

    # -- Plugin capabilities: this plugin controls device, precision and checkpoint IO ------
    def supported_devices(self) -> list[str]:
        return list(SUPPORTED_DEVICE_TYPES)

    def supported_precisions(self) -> list[str]:
        return self.engine.supported_precisions()

    def control_device(self) -> bool:
        return True

    def control_precision(self) -> bool:
        return True

    def control_checkpoint_io(self) -> bool:
        return True

    def support_no_sync(self) -> bool:
        return self.engine.support_no_sync()

    def support_lora(self) -> bool:
        return self.engine.support_lora()

    # -- Plugin operations, delegated to the engine -----------------------------------------
    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Callable | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> tuple:
        """Shard ``model`` and wrap ``optimizer`` for the layout (see HybridParallelPlugin)."""
        model, moe, sfb = self._shard_for_layout(model, dataloader)
        boosted = self.engine.configure(model, optimizer, criterion, dataloader, lr_scheduler)
        self._attach_runtime(boosted, moe, sfb)
        return boosted

    def _shard_for_layout(self, model: nn.Module, dataloader: DataLoader | None) -> tuple:
        """Plan the layout and pick the shardformer policy; no collective except 2D's plan.

        Returns ``(model, moe, sfb)``: the model (2D-converted when ``tp_mode`` is 2d), the
        MoE wiring or None, and the planned SFB modules.
        """
        keep_gpt2_causal(model)
        check_stage_split(self.config.parallel, model.config.num_hidden_layers)  # no collective
        # pp > 1: layers per stage on unequal devices, micro-batches and k when the config says
        # 0, each stage's TP widths on unequal devices (every rank plans alike; collective only
        # to measure the device model when plan.reference_tflops is unset)
        self.stage_plan, self.stage_widths = plan_pipeline_at_configure(self, model, dataloader)
        two_d = self.config.parallel.tp_mode == "2d"
        if self.plan is None and not two_d:  # measures the devices unless reference_tflops
            self.plan = plan_at_configure(
                self.config, model, self.world_size, self.device, self.workload, dataloader
            )
        resizes = self.plan is not None or bool(self.stage_widths) or needs_resizable(self.config)
        if two_d:  # the Optimus/SUMMA mesh (tp2d/) replaces 1D sharding; collective
            if self.plan is None:  # block sizes and positions for unequal devices, or None
                self.plan_2d = plan_2d_at_configure(
                    self.config,
                    model,
                    self.engine.tp_group,
                    self.world_size,
                    self.workload,
                    dataloader,
                    self.rank,
                    self._run_dir,
                )
            model = convert_to_2d(model, self.engine.tp_group, self.plan or self.plan_2d)
            self.engine.custom_policy = Converted2DPolicy()
        elif self._policy is None and resizes and self.tp_size > 1:
            widths = self.plan.widths if self.plan is not None else self.stage_widths  # {}: even
            self.engine.custom_policy = resizable_policy(model, widths)
        moe = None  # expert parallelism: checked here, on every rank, before any collective
        if self.config.parallel.ep > 1 and self._policy is None:
            moe = moe_policy(self.config, model, self.world_size)
            self.engine.custom_policy = moe.policy
        sfb = planned_sfb(self.plan, self.config.parallel, self.dp_size)
        exclude_sfb_from_ddp(model, sfb)  # SFB modules sync by gathered factors, not DDP
        return model, moe, sfb

    def _attach_runtime(self, boosted: tuple, moe: Any, sfb: Any) -> None:
        """Wire the boosted model and optimizer to the step seam's runtime features."""
        self.plan, note = plan_that_runs(self.plan, self._policy, self.tp_size)
        announce(self.plan, note, self.rank, self._run_dir)
        if isinstance(self.engine.custom_policy, ResizablePolicy):
            _drop_single_rank_ddp(boosted[0])
        self.grad_sync = install_planned_sfb(boosted[0], sfb)
        if self.config.emulation.enabled:  # DDP's C++ all-reduces must meet the emulation too
            route_ddp_through_interceptor(boosted[0])
        # Steps open at training forwards and close after optimizer.step(); under pipeline
        # parallelism the loss comes from execute_pipeline, not from per-micro-batch backward.
        self.seam.attach(boosted[0], boosted[1], note_losses=self.pp_size == 1)
        if moe is not None:  # flushed by optimizer.step (after the seam's wrapper is on)
            if not self.engine.reduces_gradients:
                self.moe_reducers = install_reducers(
                    self.config, boosted[0], boosted[1], moe.comm, self.dp_size
                )
            log = MoeStepLog(moe.comm, moe.placement, self._run_dir, self.rank)
            self.moe_log = self.seam.add(log)
            if self.config.moe.replace_every:  # after the log: a step's record, then the move
                model_, optim_ = boosted[0], boosted[1]
                replacer = build_replacer(
                    self.config, model_, optim_, self.moe_reducers, self._run_dir, self.rank
                )
                self.moe_replacer = self.seam.add(replacer)
        if self.config.balancer.mode != "none":  # after the metrics writer: it logs first
            ops = self._layer_ops
            balancer = build_balancer(self, boosted[0], boosted[1], self._run_dir, ops)
            self.balancer = self.seam.add(balancer)

    def _layer_ops(self, model: nn.Module) -> LayerOps | LayerOps2D:
        """The in-layer actuator of the layout (1D or 2D SUMMA layers) with
        ``balancer.priority``."""
        ops = LayerOps2D if self.config.parallel.tp_mode == "2d" else LayerOps
        return ops(model, priority=self.config.balancer.priority)

    def resize(self, model: nn.Module, optimizer: Any, widths: dict[str, list[int]]) -> None:
        """Move tensor-parallel shards to new ``widths`` between steps, losslessly.

        Weights, gradients and the optimizer's state move with them, and under mixed precision
        the fp32 master weights and their state, exactly (``widths`` keys: heads, ffn, vocab;
        missing keys are split evenly). With data parallelism each replica's TP group resizes
        the same way and the torch DDP is rebuilt. Call on every rank, between steps (or
        between backward and step), with the booster's model and optimizer and the same
        ``widths`` on every rank: the widths are checked equal over the world (one small
        all-reduce) before anything moves. See plugin/resizing.py for the collectives.

        Raises:
            ValueError: the model was not sharded with resizable layers, the layout uses ZeRO
                (``parallel.zero_stage`` > 0), the model or optimizer is not the booster's
                (mixed precision needs its optimizer), all raised before any collective; or
                the widths differ across ranks or do not fit the model, raised on every rank.
        """
        policy = self.engine.custom_policy
        if not isinstance(policy, ResizablePolicy):
            raise ValueError(
                "resize needs resizable layers: plan.mode auto or file with tp > 1, or a "
                "resizable policy"
            )
        world = dist.group.WORLD
        assert world is not None  # initialised before construction
        resize_boosted(
            model,
            optimizer,
            policy,
            widths,
            zero_stage=self.config.parallel.zero_stage,
            ddp_options=self.engine.ddp_config,
            group=world,
            device=self.device,
        )
        if self.config.emulation.enabled:  # a rebuilt DDP has lost the emulation's hook
            route_ddp_through_interceptor(model)

    def execute_pipeline(
        self,
        data_iter: Iterator,
        model: nn.Module,
        criterion: Callable[[Any, Any], torch.Tensor],
        optimizer: Any = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict:
        """Forward and backward of one step's micro-batches through the pipeline.

        Opens a step on the seam unless one is open: the step spans every micro-batch (and a
        later stage's wait for activations) until the optimizer's ``step()`` closes it.
        """
        self.seam.ensure_open()
        result = self.engine.execute_pipeline(
            data_iter, model, criterion, optimizer, return_loss, return_outputs
        )
        self.seam.note_loss(result.get("loss"))
        return result

    def forward_pipeline(
        self,
        data_iter: Iterator,
        model: nn.Module,
        criterion: Callable,
        return_outputs: bool = False,
    ) -> dict:
        """Forward-only pass of one batch through the pipeline (for validation).

        Runs the schedule directly: Colossal-AI's ``execute_pipeline`` would afterwards
        all-reduce the gradients of shared parameters (tied embeddings), which a forward-only
        pass does not have, and fail.
        """
        with torch.no_grad():
            return self.engine.scheduler.forward_backward_step(
                model, data_iter, criterion, None, return_loss=True, return_outputs=return_outputs
            )

    def get_checkpoint_io(self) -> CheckpointIO:
        """Colossal-AI's hybrid checkpoint IO, extended to uneven TP optimizer states; with
        ``parallel.ep > 1`` the expert-parallel one (placement-free names, checkpoint/moe.py)."""
        engine = self.engine
        if isinstance(engine, MoeEngine):
            return MoeCheckpointIO(
                engine.mixed_dp_group,
                engine.pp_group,
                engine.tp_group,
                engine.sp_group,
                engine.zero_stage,
                ep_group=engine.ep_group,
                moe_dp_group=engine.moe_dp_group,
            )
        return HeteroCheckpointIO(
            engine.mixed_dp_group,
            engine.pp_group,
            engine.tp_group,
            engine.sp_group,
            engine.zero_stage,
        )

    def no_sync(self, model: nn.Module, optimizer: Any) -> AbstractContextManager:
        return self.engine.no_sync(model, optimizer)

    def enable_lora(
        self,
        model: nn.Module,
        pretrained_dir: str | None = None,
        lora_config: Any = None,
        bnb_quantization_config: Any = None,
    ) -> nn.Module:
        return self.engine.enable_lora(model, pretrained_dir, lora_config, bnb_quantization_config)

    def prepare_dataloader(
        self, dataset: Any, batch_size: int, *args: Any, **kwargs: Any
    ) -> DataLoader:
        return self.engine.prepare_dataloader(dataset, batch_size, *args, **kwargs)


def _drop_single_rank_ddp(model: Any) -> None:
    """Unwrap the torch DDP that HybridParallelPlugin adds even when dp == 1.

    Over one data-parallel rank DDP only adds its reducer, which pins every parameter's
    gradient shape; resizable layers must be free to change shapes between steps.
    """
    from torch.nn.parallel import DistributedDataParallel

    if (
        isinstance(model.module, DistributedDataParallel)
        and dist.get_world_size(model.dp_group) == 1
    ):
        model.module, model.use_ddp = model.module.module, False


def _device_for(config: HeteroConfig) -> torch.device:
    """This rank's device, checked against the backend the process group was started with."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    device = resolve_device(config.cluster.device, local_rank, local_world_size)
    backend = dist.get_backend()
    if backend != backend_for(device):
        raise ConfigError(
            f"cluster.device: resolves to {device.type}, which needs the "
            f"{backend_for(device)} backend, but the process group uses {backend}"
        )
    return device
