"""Config checks of the pipeline schedule (``parallel.pp_schedule`` and its fields). Pure.

Called from ``preflight/validate.py`` on every rank before any collective, so a bad schedule
setting raises the same one-line ``ConfigError`` everywhere. What needs the model (a memory
budget below one micro-batch's measured activations) is checked at runtime by
``pipeline/seam_adapter.py``, also on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.schema import HeteroConfig, ParallelConfig
from colossal_hetero.utils.device import kind_needs_accelerator

MIB = 1 << 20


def check_pipeline_config(config: HeteroConfig) -> None:
    """Raise ConfigError (one line naming the field) for a schedule the layout cannot run.

    Refused: a ``num_layers_per_stage`` with the wrong number of entries or an empty stage;
    kfkb or ada_kfkb without pipeline parallelism; ``pp_k`` above the micro-batch
    count; kfkb on a ``cluster.device`` whose backend is NCCL (KFKBSchedule's early-posted
    receives would hang there, see pipeline/schedule.py). With ``cluster.device: auto`` the
    backend is only known at runtime, where KFKBSchedule refuses a non-gloo group with the
    same field name.
    """
    parallel = config.parallel
    if parallel.num_layers_per_stage:  # its count and positivity; the sum needs the model
        check_stage_split(parallel, sum(parallel.num_layers_per_stage))
    schedule = parallel.pp_schedule
    if schedule == "1f1b":
        return
    if parallel.pp == 1:
        raise ConfigError(
            f"parallel.pp_schedule: {schedule} needs pipeline parallelism (parallel.pp > 1), "
            "got pp = 1"
        )
    if parallel.pp_k > parallel.num_microbatches > 0:  # a planned count (0) keeps m >= pp_k
        raise ConfigError(
            f"parallel.pp_k: {parallel.pp_k} is larger than parallel.num_microbatches "
            f"({parallel.num_microbatches})"
        )
    if kind_needs_accelerator(config.cluster.device):
        raise ConfigError(
            f"parallel.pp_schedule: {schedule} runs on gloo only (cluster.device cpu); "
            f"on {config.cluster.device} (NCCL) its early-posted receives would hang"
        )


def check_layers_per_stage(layers_per_stage: Sequence[int], num_layers: int, pp: int) -> None:
    """Raise ValueError unless a given split has ``pp`` positive entries summing to the layers."""
    field_name = "parallel.num_layers_per_stage"
    if len(layers_per_stage) != pp:
        raise ValueError(f"{field_name}: {len(layers_per_stage)} entries for {pp} stages")
    if any(n < 1 for n in layers_per_stage):
        raise ValueError(f"{field_name}: every stage needs a layer, got {list(layers_per_stage)}")
    if sum(layers_per_stage) != num_layers:
        raise ValueError(
            f"{field_name}: {list(layers_per_stage)} sums to {sum(layers_per_stage)}, "
            f"the model has {num_layers} layers"
        )


def check_stage_split(parallel: ParallelConfig, num_layers: int) -> None:
    """Raise ConfigError naming ``parallel.num_layers_per_stage`` unless it is empty or gives
    each of the ``pp`` stages at least one layer and sums to the model's ``num_layers``."""
    if parallel.num_layers_per_stage:
        try:
            check_layers_per_stage(parallel.num_layers_per_stage, num_layers, parallel.pp)
        except ValueError as error:
            raise ConfigError(str(error)) from None


def budget_bytes(config: HeteroConfig) -> float | None:
    """``parallel.pp_memory_budget_mib`` in bytes (None: no limit)."""
    mib = config.parallel.pp_memory_budget_mib
    return None if mib is None else mib * MIB


def check_budget(config: HeteroConfig, activation_bytes: float) -> None:
    """Raise ValueError naming ``parallel.pp_memory_budget_mib`` when the budget is below one
    micro-batch's activations (``activation_bytes``: the largest measured on any rank)."""
    budget = budget_bytes(config)
    if budget is not None and budget < activation_bytes:
        raise ValueError(
            f"parallel.pp_memory_budget_mib: {budget / MIB:.4g} MiB is below one micro-batch's "
            f"activations ({activation_bytes / MIB:.4g} MiB measured)"
        )
