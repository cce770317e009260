"""Build the Colossal-AI HybridParallelPlugin that executes a layout (the "engine").

The hetero plugin delegates sharding, optimizer wrapping, pipeline schedules and checkpoint IO
to it; this module is the one place that maps our config onto its keyword arguments.
"""

from __future__ import annotations

from typing import Any

import torch
from colossalai.booster.plugin import HybridParallelPlugin

from colossal_hetero.config.schema import HeteroConfig
from colossal_hetero.utils.device import has_side_streams


def engine_kwargs(config: HeteroConfig, device: torch.device, policy: Any = None) -> dict[str, Any]:
    """HybridParallelPlugin keyword arguments for ``config`` on ``device``."""
    parallel = config.parallel
    kwargs: dict[str, Any] = {
        "tp_size": parallel.tp,
        "pp_size": parallel.pp,
        "zero_stage": parallel.zero_stage,
        "precision": parallel.precision,
        "max_norm": parallel.max_norm,
        "custom_policy": policy,
        # On CPU there are no side streams to overlap on; every collective is synchronous.
        "overlap_communication": has_side_streams(device),
        "overlap_p2p": has_side_streams(device),
    }
    if parallel.pp > 1:
        kwargs["num_microbatches"] = parallel.num_microbatches
        if parallel.num_layers_per_stage:  # else Colossal-AI's even split
            kwargs["num_layers_per_stage"] = list(parallel.num_layers_per_stage)
    if parallel.precision == "fp16":
        kwargs["initial_scale"] = 2**16
    return kwargs


def build_engine(
    config: HeteroConfig, device: torch.device, policy: Any = None
) -> HybridParallelPlugin:
    """A HybridParallelPlugin for ``config``. Needs an initialised default process group."""
    return HybridParallelPlugin(**engine_kwargs(config, device, policy))
