"""Checks that need the world size or the model: run on every rank before any collective.

Every rank loads the same YAML and runs the same checks, so an impossible layout raises the
same ``ConfigError`` everywhere and no rank is left waiting in a collective.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.schema import EmulationConfig, HeteroConfig, ModelConfig, RunConfig
from colossal_hetero.moe.checks import check_moe_layout, check_moe_model, check_moe_run
from colossal_hetero.pipeline.validate import check_pipeline_config, check_stage_split


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
    if config.parallel.tp_mode == "auto":  # needs the model and data sections to choose
        raise ConfigError(
            "parallel.tp_mode: auto is chosen from the whole run config by colossal-hetero "
            "train, check and plan (plan prints the pick); give the plugin 1d or 2d"
        )
    devices = config.cluster.devices
    if devices and len(devices) != world_size:
        raise ConfigError(
            f"cluster.devices: lists {len(devices)} devices but the world size is {world_size}"
        )
    _validate_emulation(config.emulation, world_size)
    check_pipeline_config(config)
    check_moe_layout(config.parallel, config.moe, world_size)
    check_moe_run(config)  # ep with tp > 1: plan file and balancer refused
    _check_2d(config, None)
    return dp


def _check_2d(config: HeteroConfig, hf_config: Any) -> None:
    """parallel.tp_mode 2d: the layout (and the model, when given) fit tp2d/convert.py."""
    if config.parallel.tp_mode != "2d":
        return
    from colossal_hetero.tp2d.convert import check_config_2d, check_model_2d

    try:
        q = check_config_2d(config.parallel)
        if hf_config is not None:
            check_model_2d(hf_config, q)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _validate_emulation(emulation: EmulationConfig, world_size: int) -> None:
    for i, slowdown in enumerate(emulation.slowdowns):
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
    """Check a whole run (layout, model shape, memory, data) against the world size.

    Builds the model's transformers config (not its weights). Returns the dp size.

    Raises:
        ConfigError: one line naming the field, the same on every rank.
    """
    from colossal_hetero.planner.resolve import wants_plan

    dp = validate_layout(config.plugin_config(), world_size)
    planned = wants_plan(config.plugin_config())
    hf_config = checked_hf_config(config.model)
    _validate_model_shape(config, hf_config, planned=planned)
    check_moe_model(config.parallel, config.moe, hf_config, world_size)
    check_moe_run(config)
    parallel = config.parallel
    if hf_config.num_hidden_layers < parallel.pp:
        raise ConfigError(
            f"parallel.pp: {parallel.pp} stages but the model has only "
            f"{hf_config.num_hidden_layers} layers"
        )
    check_stage_split(parallel, hf_config.num_hidden_layers)
    wants_images = config.model.arch == "vit"
    if wants_images != (config.data.dataset == "digits"):
        raise ConfigError(
            f"data.dataset: {config.data.dataset!r} does not fit model.arch "
            f"{config.model.arch!r} (vit trains on digits, text models on pydoc_topics)"
        )
    if planned and not parallel.batch_shares:
        pass  # the plan's group shares sum to the global batch by construction
    elif parallel.batch_shares or parallel.batch_split != "even":
        from colossal_hetero.planner.batch_shares import batch_shares

        batch_shares(config.plugin_config(), world_size, dp, config.data.global_batch_size)
    else:
        _validate_even_split(config, dp)
    max_positions = getattr(hf_config, "max_position_embeddings", 0) or 0
    if config.model.arch != "vit" and config.data.seq_len > max_positions:
        raise ConfigError(
            f"data.seq_len: {config.data.seq_len} exceeds the model's {max_positions} positions"
        )
    _validate_eval_size(config)
    if not planned and parallel.tp_mode != "2d":  # 1D memory model; plans are checked
        check_even_memory(config, world_size, hf_config)
    return dp


def _validate_even_split(config: RunConfig, dp: int) -> None:
    parallel = config.parallel
    samples_per_rank, rest = divmod(config.data.global_batch_size, dp)
    if rest:
        raise ConfigError(
            f"data.global_batch_size: {config.data.global_batch_size} is not divisible by the "
            f"data-parallel size {dp}"
        )
    side = math.isqrt(parallel.tp)  # parallel.tp_mode 2d: samples per mesh row
    if parallel.tp_mode == "2d" and samples_per_rank % side:
        raise ConfigError(
            f"data.global_batch_size: {samples_per_rank} samples per data-parallel group do not "
            f"split evenly over the {side} mesh rows of parallel.tp_mode 2d"
        )
    planned_m = parallel.num_microbatches == 0  # the stage planner picks a divisor
    if parallel.pp > 1 and not planned_m and samples_per_rank % parallel.num_microbatches:
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


# -- the model's shape -------------------------------------------------------------------------

# The model.hf names of the sizes checked below, per architecture (GPT-2 has its own names).
_STANDARD_NAMES = {
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "layers": "num_hidden_layers",
    "ffn": "intermediate_size",
}
_HF_NAMES = {
    "gpt2": {"hidden": "n_embd", "heads": "n_head", "layers": "n_layer", "ffn": "n_inner"},
    "llama": _STANDARD_NAMES,
    "mixtral": _STANDARD_NAMES,
    "bert": _STANDARD_NAMES,
    "vit": _STANDARD_NAMES,
}


# Sizes whose transformers default is None (derived) but that must be ints when given.
_OPTIONAL_SIZES = frozenset({"n_inner", "head_dim", "num_key_value_heads"})


def checked_hf_config(model: ModelConfig) -> Any:
    """The transformers config of ``model``, with every ``model.hf`` value type-checked first
    against the config class's default (transformers itself checks almost none).

    Raises:
        ConfigError: naming ``model.hf.<key>`` (unknown key, wrong type), or ``model.hf`` when
            transformers refuses the combination.
    """
    from colossal_hetero.models import build_hf_config

    reference = build_hf_config(ModelConfig(arch=model.arch))
    for key, value in model.hf.items():
        if hasattr(reference, key):
            default = getattr(reference, key)
            if default is None and key in _OPTIONAL_SIZES:
                default = 0  # an int or null
            _check_hf_type(f"model.hf.{key}", default, value)
    try:
        return build_hf_config(model)
    except ConfigError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        what = " ".join(str(error).split())
        raise ConfigError(f"model.hf: transformers.{type(reference).__name__}: {what}") from None


def _check_hf_type(path: str, default: Any, value: Any) -> None:
    """``value`` must have the type of the field's ``default`` (int accepted for float);
    fields whose default is None take any value."""
    if default is None or value is None:
        return
    expected = type(default)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return
    if isinstance(value, expected) and (expected is bool or not isinstance(value, bool)):
        return
    hint = ""
    if isinstance(value, str) and expected in (int, float) and _is_number(value):
        exponent = "e" in value.lower()
        hint = " (YAML reads 1e-5 as text: write 1.0e-5)" if exponent else " (drop the quotes)"
    raise ConfigError(
        f"{path}: expected {expected.__name__}, got {type(value).__name__} {value!r}{hint}"
    )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _validate_model_shape(config: RunConfig, hf_config: Any, *, planned: bool) -> None:
    """Head, key/value-head and MLP divisibility that the layers (ours, Colossal-AI's,
    transformers') would otherwise assert at ``booster.boost``."""
    arch, tp = config.model.arch, config.parallel.tp
    if config.parallel.tp_mode == "2d":  # whole heads per mesh column, not per rank
        return _check_2d(config.plugin_config(), hf_config)
    names = _HF_NAMES[arch]
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    sizes = {
        names["hidden"]: hidden,
        names["heads"]: heads,
        names["layers"]: hf_config.num_hidden_layers,
        "num_key_value_heads": kv_heads,
    }
    for name, value in sizes.items():
        if value < 1:
            raise ConfigError(f"model.hf.{name}: must be >= 1, got {value}")
    explicit_head_dim = arch == "llama" and config.model.hf.get("head_dim") is not None
    if hidden % heads and not explicit_head_dim:
        raise ConfigError(
            f"model.hf.{names['heads']}: {heads} attention heads do not divide the hidden size "
            f"{hidden} ({names['hidden']})"
        )
    if heads % kv_heads:
        raise ConfigError(
            f"model.hf.num_key_value_heads: {kv_heads} key/value heads do not divide the "
            f"{heads} attention heads"
        )
    what = (
        f"{heads} attention heads"
        if kv_heads == heads
        else f"{kv_heads} key/value heads (num_key_value_heads; {heads} attention heads)"
    )
    if planned:
        # Uneven plans give every rank whole key/value heads; a rank needs at least one.
        if tp > kv_heads:
            raise ConfigError(f"parallel.tp: {tp} ranks but the model has only {what}")
        return
    even = "set plan.mode: auto with heterogeneous devices for uneven widths"
    if heads % tp or kv_heads % tp:
        raise ConfigError(f"parallel.tp: {tp} does not divide the {what} of model.hf ({even})")
    ffn = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "n_inner", None)
    ffn = ffn or 4 * hidden  # GPT-2's n_inner: null means 4 * n_embd
    if ffn % tp:
        raise ConfigError(
            f"parallel.tp: {tp} does not divide the MLP width {ffn} of model.hf "
            f"({names['ffn']}) under the even split ({even})"
        )


def check_even_memory(config: RunConfig, world_size: int, hf_config: Any) -> None:
    """Each listed device must hold its even shard, as the planner's memory model counts it
    (weights, gradients, optimizer states, saved activations). Pipelines and expert
    parallelism are not modelled: the planner has no MoE memory model, and an expert-parallel
    run lists its devices for their speeds (``moe.replace_every``), so it is not checked here.

    Raises:
        ConfigError: naming ``cluster.devices[d].memory_gib`` of the first device that is short.
    """
    devices = config.cluster.devices
    if not devices or config.parallel.pp > 1 or config.parallel.ep > 1:
        return
    from colossal_hetero.planner.cost import CostModel
    from colossal_hetero.planner.hf import model_spec_from_hf
    from colossal_hetero.planner.search import Problem, Space, astar
    from colossal_hetero.planner.shares import program_memory, round_shares, uniform_shares
    from colossal_hetero.planner.spec import ClusterSpec, Mesh

    parallel = config.parallel
    dtype_bytes = 4 if parallel.precision == "fp32" else 2
    spec = model_spec_from_hf(
        hf_config, config.data.global_batch_size, config.data.seq_len, dtype_bytes=dtype_bytes
    )
    mesh = Mesh.for_devices(world_size, parallel.tp)
    cost = CostModel(ClusterSpec.from_config(config.cluster, world_size), spec, mesh)
    space = Space.executed(tp=parallel.tp, pp=1, zero_stage=parallel.zero_stage)
    problem = Problem(cost, space)
    loads = round_shares(spec, mesh, uniform_shares(mesh)).loads(mesh)
    used = program_memory(problem, astar(problem, loads), loads)
    for d, device in enumerate(devices):
        need = float(used[d]) / 2**30
        if need > device.memory_gib:
            raise ConfigError(
                f"cluster.devices[{d}].memory_gib: {device.memory_gib:g} GiB, but its even shard "
                f"needs about {need:.3g} GiB (weights, gradients, optimizer states, activations)"
            )


# -- the host ----------------------------------------------------------------------------------


def validate_launch(config: RunConfig, world_size: int, local_world_size: int) -> int:
    """Everything a launch checks before its first collective, except the plan: the run
    (:func:`validate_run`), the device kind on this host, and the output folders. Returns dp.

    Raises:
        ConfigError: one line naming the field, the same on every rank.
    """
    dp = validate_run(config, world_size)
    from colossal_hetero.utils.device import resolve_device

    try:
        resolve_device(config.cluster.device, 0, local_world_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    _check_creatable(config.logging.dir, "logging.dir")
    if config.checkpoint.dir is not None:
        _check_creatable(config.checkpoint.dir, "checkpoint.dir")
    return dp


def _check_creatable(folder: str, field: str) -> None:
    """``folder`` exists as a writable folder, or can be made under its nearest existing
    ancestor. Creates nothing."""
    path = Path(folder)
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{field}: cannot create {folder}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{field}: cannot write under {ancestor} (permission denied)")
