"""The engine of an expert-parallel layout: Colossal-AI's ``MoeHybridParallelPlugin``.

Its process groups (the ``(moe_dp, pp, ep, tp, sp)`` mesh, ``ep_group``, ``moe_dp_group``,
``dp_group``) and optimizer wrappers are reused as they are. What changes is who reduces the
gradients:

- ``parallel.zero_stage`` 1 or 2: Colossal-AI's own path (``MoeHybridParallelZeroOptimizer``;
  it turns ZeRO-2 into 1 and never overlaps its reduction). Used as the stock baseline.
- ``parallel.zero_stage`` 0 (any precision, fp32 included): the model is sharded without
  torch DDP (which needs one data-parallel group; the stock plugin refuses this layout), the
  optimizer is Colossal-AI's naive (fp32) or AMP (fp16/bf16) wrapper, and our
  :class:`.scheduler.ChunkedGradReducer` s (moe/wiring.py) reduce the gradients. The
  wrapper clips (``max_norm``) by the global norm of moe/clip.py, which wiring installs in
  place of its own (a rank's own norm would miss the experts held elsewhere), and
  ``no_sync`` is Colossal-AI's: it turns off the model's ``require_grad_sync``, which the
  reducers follow (gradient accumulation).
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
from colossalai.booster.plugin.hybrid_parallel_plugin import (
    HybridParallelAMPOptimizer,
    HybridParallelModule,
    HybridParallelNaiveOptimizer,
    get_param_info,
)
from colossalai.booster.plugin.moe_hybrid_parallel_plugin import MoeHybridParallelPlugin
from colossalai.interface import ModelWrapper, OptimizerWrapper

from colossal_hetero.config.schema import HeteroConfig


class MoeEngine(MoeHybridParallelPlugin):
    """``MoeHybridParallelPlugin`` whose ``configure`` leaves gradient sync to our reducers
    when ZeRO is off (see the module)."""

    @property
    def reduces_gradients(self) -> bool:
        """True when Colossal-AI's optimizer reduces the gradients (ZeRO), False for ours."""
        return self.zero_stage > 0

    def configure(
        self,
        model: Any,
        optimizer: Any = None,
        criterion: Any = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple:
        if self.reduces_gradients:
            return super().configure(model, optimizer, criterion, dataloader, lr_scheduler)
        param_info = get_param_info(optimizer)
        if not isinstance(model, ModelWrapper):
            model = HybridParallelModule(
                module=model,
                precision=self.precision,
                shard_config=self.shard_config,
                dp_group=self.mixed_dp_group,
                tp_group=self.tp_group,
                sp_group=self.sp_group,
                use_ddp=False,  # our reducers sync the gradients
                ddp_config=self.ddp_config,
                custom_policy=self.custom_policy,
            )
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            # use_pipeline=True drops the parameters of experts held elsewhere from the groups.
            if self.precision in ("fp16", "bf16"):
                optimizer = HybridParallelAMPOptimizer(
                    optimizer,
                    model,
                    use_pipeline=True,
                    param_info=param_info,
                    precision=self.precision,
                    max_norm=self.max_norm,
                    **self.amp_config,
                )
            else:
                optimizer = HybridParallelNaiveOptimizer(
                    optimizer,
                    model,
                    use_pipeline=True,
                    param_info=param_info,
                    max_norm=self.max_norm,
                    pp_process_group=self.pp_group,
                    tp_process_group=self.tp_group,
                )
            model.update_master_params = MethodType(optimizer.update_master_params, model)
        return model, optimizer, criterion, dataloader, lr_scheduler


def build_moe_engine(config: HeteroConfig, device: torch.device, policy: Any = None) -> MoeEngine:
    """The engine for ``parallel.ep > 1`` (pp = 1, checked by config validation; tp > 1:
    Colossal-AI's mesh puts the tp peers of one data-parallel rank next to each other)."""
    parallel = config.parallel
    kwargs: dict[str, Any] = {}
    if parallel.precision == "fp16":
        kwargs["initial_scale"] = 2**16
    return MoeEngine(
        tp_size=parallel.tp,
        pp_size=1,
        ep_size=parallel.ep,
        precision=parallel.precision,
        zero_stage=parallel.zero_stage,
        max_norm=parallel.max_norm,
        custom_policy=policy,
        overlap_communication=False,
        **kwargs,
    )
