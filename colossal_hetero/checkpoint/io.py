"""HeteroCheckpointIO: Colossal-AI's hybrid-parallel checkpoint IO, plus uneven TP optimizers.

Models need nothing extra: resizable and 2D layers carry shard/gather hooks that Colossal-AI's
model IO already uses, so saved weights are full Hugging Face tensors. Optimizers of models with
uneven or 2D shards go through ``optimizer_state`` (full states keyed by position); loading that
format works into any widths, even or uneven.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from colossalai.checkpoint_io import HybridParallelCheckpointIO
from torch import nn

from colossal_hetero.checkpoint.optimizer_state import (
    has_uneven_params,
    is_full_format,
    load_full_optimizer,
    save_full_optimizer,
    stage_file_name,
)
from colossal_hetero.tp2d.state import has_2d_params, is_model_2d


class HeteroCheckpointIO(HybridParallelCheckpointIO):
    """Checkpoint IO for HeteroParallelPlugin (same constructor as the stock one)."""

    def save_optimizer(
        self, optimizer: Any, checkpoint: str, shard: bool = False, *args: Any, **kwargs: Any
    ) -> None:
        """Stock format, or full states when some parameter is unevenly sharded."""
        if not (has_uneven_params(optimizer) or has_2d_params(optimizer)):
            return super().save_optimizer(optimizer, checkpoint, shard, *args, **kwargs)
        self._require_full_format_layout("save")
        writer = self.dp_rank == 0 and self.tp_rank == 0
        save_full_optimizer(
            optimizer,
            checkpoint,
            gather_even=self._gather_even(optimizer),
            is_writer=writer,  # one per pipeline stage, each writing its own file
            file_name=stage_file_name(self.pp_rank, self.pp_size),
        )
        return None

    def save_sharded_model(self, model: Any, checkpoint: str, *args: Any, **kwargs: Any) -> None:
        """Stock shards of full HF tensors; a 2D model (tp2d/) also writes its HF config, so
        the folder is a Hugging Face pretrained folder as for stock models."""
        super().save_sharded_model(model, checkpoint, *args, **kwargs)
        if is_model_2d(model.unwrap()) and dist.get_rank() == 0:
            model.unwrap().config.save_pretrained(checkpoint)

    def load_optimizer(self, optimizer: Any, checkpoint: str, *args: Any, **kwargs: Any) -> None:
        """Either format; full states are re-sharded to the current widths."""
        if not is_full_format(checkpoint):
            if has_2d_params(optimizer):  # the stock format's shards assume 1D layouts
                raise ValueError(
                    f"{checkpoint}: a 2D (parallel.tp_mode 2d) optimizer loads only the full "
                    "format this plugin saves (full_optimizer.pt), not Colossal-AI's sharded one"
                )
            return super().load_optimizer(optimizer, checkpoint, *args, **kwargs)
        self._require_full_format_layout("load")
        load_full_optimizer(optimizer, checkpoint, shard_even=self._shard_even(optimizer))
        dist.barrier()
        return None

    def _require_full_format_layout(self, action: str) -> None:
        if self.use_zero:
            raise ValueError(
                f"cannot {action} the optimizer of unevenly sharded layers with ZeRO; use "
                "plan.mode: even for that layout"
            )

    def _gather_even(self, optimizer: Any) -> Callable[[dict, nn.Parameter], dict]:
        shapes = optimizer.param_info["param2shape"]

        def gather(state: dict, working: nn.Parameter) -> dict:
            return HybridParallelCheckpointIO.gather_from_sharded_optimizer_state(
                state,
                working,
                shapes[id(working)],
                self.global_dp_group,
                self.tp_group,
                use_zero=False,
                inplace=False,
            )

        return gather

    def _shard_even(self, optimizer: Any) -> Callable[[dict, nn.Parameter, nn.Parameter], dict]:
        shapes = optimizer.param_info["param2shape"]

        def shard(state: dict, working: nn.Parameter, param: nn.Parameter) -> dict:
            return self.shard_from_complete_optimizer_state(
                state,
                current_shape=working.shape,
                original_shape=shapes[id(working)],
                device=param.device,
                dtype=param.dtype,
                inplace=True,
            )

        return shard
