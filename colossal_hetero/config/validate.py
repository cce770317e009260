"""Checks that need the world size or the model: run on every rank before any collective.

Every rank loads the same YAML and runs the same checks, so an impossible layout raises the
same ``ConfigError`` everywhere and no rank is left waiting in a collective.
"""

from __future__ import annotations

from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.schema import EmulationConfig, HeteroConfig, RunConfig


def resolve_dp(config: HeteroConfig, world_size: int) -> int:
    """The data-parallel size implied by the layout and the world size."""
    parallel = config.parallel
    model_parallel = parallel.tp * parallel.pp
    if world_size % model_parallel != 0:
        raise ConfigError(
            f"parallel: tp * pp = {parallel.tp} * {parallel.pp} = {model_parallel} "
            f"does not divide the world size {world_size}"
        )
    dp = parallel.dp or world_size // model_parallel
    if parallel.tp * parallel.pp * dp != world_size:
        raise ConfigError(
            f"parallel: tp * pp * dp = {parallel.tp} * {parallel.pp} * {dp} = "
            f"{parallel.tp * parallel.pp * dp} != world size {world_size}"
        )
    return dp


def validate_layout(config: HeteroConfig, world_size: int) -> int:
    """Check the plugin's part of a config against the world size; returns the dp size."""
    dp = resolve_dp(config, world_size)
    devices = config.cluster.devices
    if devices and len(devices) != world_size:
        raise ConfigError(
            f"cluster.devices: lists {len(devices)} devices but the world size is {world_size}"
        )
    _validate_emulation(config.emulation, world_size)
    return dp


def _validate_emulation(emulation: EmulationConfig, world_size: int) -> None:
    for i, slowdown in enumerate(emulation.compute):
        if slowdown.rank >= world_size:
            raise ConfigError(
                f"emulation.compute[{i}].rank: rank {slowdown.rank} does not exist "
                f"(world size {world_size})"
            )
    for i, link in enumerate(emulation.network.links):
        bad = [r for r in link.ranks if not 0 <= r < world_size]
        if bad or link.ranks[0] == link.ranks[1]:
            raise ConfigError(
                f"emulation.network.links[{i}].ranks: {link.ranks} is not a link between two "
                f"ranks of {world_size}"
            )
    for i, preemption in enumerate(emulation.network.preemptions):
        bad = [r for r in preemption.ranks if not 0 <= r < world_size]
        if bad:
            raise ConfigError(
                f"emulation.network.preemptions[{i}].ranks: ranks {bad} do not exist "
                f"(world size {world_size})"
            )


def validate_run(config: RunConfig, world_size: int) -> int:
    """Check a whole run (layout, model shape, data) against the world size; returns dp."""
    from colossal_hetero.models import model_shape

    dp = validate_layout(config.plugin_config(), world_size)
    parallel = config.parallel
    shape = model_shape(config.model)
    from colossal_hetero.planner.resolve import wants_plan

    if wants_plan(config.plugin_config()):
        # Uneven plans give every rank whole heads; a rank needs at least one.
        if parallel.tp > shape.num_heads:
            raise ConfigError(
                f"parallel.tp: {parallel.tp} ranks but the model has only {shape.num_heads} "
                f"attention heads"
            )
    elif shape.num_heads % parallel.tp != 0:
        raise ConfigError(
            f"parallel.tp: {parallel.tp} does not divide the {shape.num_heads} attention heads "
            f"of model.hf (set plan.mode: auto with heterogeneous devices for uneven heads)"
        )
    if shape.num_layers < parallel.pp:
        raise ConfigError(
            f"parallel.pp: {parallel.pp} stages but the model has only {shape.num_layers} layers"
        )
    wants_images = config.model.arch == "vit"
    if wants_images != (config.data.dataset == "digits"):
        raise ConfigError(
            f"data.dataset: {config.data.dataset!r} does not fit model.arch "
            f"{config.model.arch!r} (vit trains on digits, text models on pydoc_topics)"
        )
    if wants_plan(config.plugin_config()) and not parallel.batch_shares:
        pass  # the plan's group shares sum to the global batch by construction
    elif parallel.batch_shares or parallel.batch_split != "even":
        from colossal_hetero.planner.batch_shares import batch_shares

        batch_shares(config.plugin_config(), world_size, dp, config.data.global_batch_size)
    else:
        _validate_even_split(config, dp)
    if config.model.arch != "vit" and config.data.seq_len > shape.max_positions:
        raise ConfigError(
            f"data.seq_len: {config.data.seq_len} exceeds the model's "
            f"{shape.max_positions} positions"
        )
    _validate_eval_size(config)
    return dp


def _validate_even_split(config: RunConfig, dp: int) -> None:
    parallel = config.parallel
    samples_per_rank, rest = divmod(config.data.global_batch_size, dp)
    if rest:
        raise ConfigError(
            f"data.global_batch_size: {config.data.global_batch_size} is not divisible by the "
            f"data-parallel size {dp}"
        )
    if parallel.pp > 1 and samples_per_rank % parallel.num_microbatches != 0:
        raise ConfigError(
            f"parallel.num_microbatches: {parallel.num_microbatches} does not divide the "
            f"{samples_per_rank} samples per data-parallel rank"
        )


def _validate_eval_size(config: RunConfig) -> None:
    from colossal_hetero.data import build_data

    if config.train.eval_every == 0:
        return
    available = build_data(config.data, config.model.arch).max_val_batches(
        config.data.global_batch_size
    )
    if config.train.eval_batches > available:
        raise ConfigError(
            f"train.eval_batches: {config.train.eval_batches} batches of "
            f"{config.data.global_batch_size} exceed the held-out data ({available} batches); "
            f"lower it or raise data.val_fraction"
        )
