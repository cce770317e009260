"""Config checks of expert parallelism (``parallel.ep`` and the ``moe`` section). Pure.

Called from ``preflight/validate.py`` (no model: the layout) and ``validate_run`` / the plugin's
``configure`` (with the model's config: experts and top-k), on every rank before any
collective, so bad input raises the same one-line ``ConfigError`` everywhere.
"""

from __future__ import annotations

from typing import Any

from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.moe import MoeConfig
from colossal_hetero.config.parallel import ParallelConfig
from colossal_hetero.moe.placement import Placement, check_ep, even_placement, placement_from_groups


def check_moe_layout(parallel: ParallelConfig, moe: MoeConfig, world_size: int) -> None:
    """The layout half: ep against tp, pp and the world; the placement's shape.

    Raises:
        ConfigError: naming ``parallel.ep`` or ``moe.placement``.
    """
    ep = parallel.ep
    if ep == 1:
        if moe.placement or moe.replace_every or moe.packing:
            field = (
                "placement"
                if moe.placement
                else "replace_every"
                if moe.replace_every
                else "packing"
            )
            raise ConfigError(f"moe.{field}: needs expert parallelism (parallel.ep > 1)")
        return
    if parallel.pp > 1:
        raise ConfigError(
            f"parallel.pp: expert parallelism runs with pp = 1 so far, got pp={parallel.pp}"
        )
    if parallel.tp > 1:
        check_moe_tp(parallel, moe)
    if world_size % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the world size ({world_size})")
    dp = parallel.dp or world_size // (parallel.tp * parallel.pp)
    if dp % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the data-parallel size ({dp})")
    # moe.replace_every runs at every zero_stage: whole experts at 0, ZeRO's master slices at
    # 1 and 2 (Colossal-AI's MoE plugin runs 2 as 1); moe/replace.py, moe/replace_zero.py.
    if moe.placement and len(moe.placement) != ep:
        raise ConfigError(
            f"moe.placement: lists {len(moe.placement)} expert-parallel ranks, parallel.ep is {ep}"
        )


def check_moe_tp(parallel: ParallelConfig, moe: MoeConfig) -> None:
    """Tensor parallelism around expert parallelism (``tp > 1`` with ``ep > 1``): what runs
    is 1D TP (attention by Colossal-AI's Mixtral policy, each held expert split over the tp
    group) with our reducers (ZeRO off), packing and pipelining included (tp peers route
    alike); re-placement (moe/replace.py moves whole experts) and the rest are refused here.

    Raises:
        ConfigError: naming the first field that cannot run with ``parallel.tp > 1``.
    """
    tp = parallel.tp
    refused = (
        ("parallel.tp_mode", parallel.tp_mode != "1d", f"{parallel.tp_mode} (only 1d)"),
        ("parallel.zero_stage", parallel.zero_stage > 0, f"{parallel.zero_stage} (only 0)"),
        ("moe.replace_every", moe.replace_every > 0, f"{moe.replace_every} (only 0)"),
    )
    for field, bad, got in refused:
        if bad:
            raise ConfigError(
                f"{field}: expert parallelism with tensor parallelism (parallel.ep="
                f"{parallel.ep}, tp={tp}) does not support it yet, got {got}"
            )


def check_moe_run(config: Any) -> None:
    """Run-level checks of a ``RunConfig`` or ``HeteroConfig``: the planner and the balancer
    do not handle tensor-parallel experts. Checkpoints do (checkpoint/moe.py gathers every tp
    shard to its full shape and slices it again on load), so ``checkpoint.dir`` runs.

    Raises:
        ConfigError: naming ``plan.mode`` or ``balancer.mode``.
    """
    parallel = config.parallel
    if parallel.ep == 1 or parallel.tp == 1:
        return
    refused = (
        ("plan.mode", config.plan.mode == "file", "file"),
        ("balancer.mode", config.balancer.mode != "none", config.balancer.mode),
    )
    for field, bad, got in refused:
        if bad:
            raise ConfigError(
                f"{field}: expert parallelism with tensor parallelism (parallel.ep="
                f"{parallel.ep}, tp={parallel.tp}) does not support it yet, got {got}"
            )


def check_moe_model(
    parallel: ParallelConfig, moe: MoeConfig, hf_config: Any, world_size: int
) -> Placement | None:
    """The model half: top-k against the experts, ep dividing the experts, the placement.

    ``hf_config`` is a ``MixtralConfig`` (or any config with ``num_local_experts`` and
    ``num_experts_per_tok``); a config without experts is refused when ``parallel.ep > 1``.
    Returns the placement of the experts over the ep ranks (None when ep is 1).

    Raises:
        ConfigError: naming ``model.hf.num_experts_per_tok``, ``parallel.ep`` or
            ``moe.placement``.
    """
    experts = getattr(hf_config, "num_local_experts", None)
    if experts is None:
        if parallel.ep > 1:
            raise ConfigError(
                f"parallel.ep: {parallel.ep} needs a mixture-of-experts model (model.arch "
                f"mixtral), got {type(hf_config).__name__}"
            )
        return None
    top_k = hf_config.num_experts_per_tok
    if not 1 <= top_k <= experts:
        raise ConfigError(
            f"model.hf.num_experts_per_tok: top-{top_k} routing needs 1 <= k <= the {experts} "
            f"experts (num_local_experts)"
        )
    check_moe_layout(parallel, moe, world_size)
    if parallel.ep == 1:
        return None
    _check_tp_experts(parallel.tp, hf_config)
    try:
        check_ep(experts, parallel.ep, world_size)
        if moe.placement:
            return placement_from_groups(moe.placement, experts)
        return even_placement(experts, parallel.ep)
    except ValueError as error:
        message = str(error)
        if message.startswith("placement:"):
            message = "moe." + message
        raise ConfigError(message) from None


def _check_tp_experts(tp: int, hf_config: Any) -> None:
    """tp > 1: each expert's FFN splits evenly over the tp group, and tp peers (which hold
    the same tokens) route alike, so no random router jitter."""
    if tp == 1:
        return
    ffn = hf_config.intermediate_size
    if ffn % tp:
        raise ConfigError(
            f"model.hf.intermediate_size: {ffn} does not split over parallel.tp={tp} (each "
            f"expert's FFN is tensor-parallel)"
        )
    jitter = float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0)
    if jitter > 0:
        raise ConfigError(
            f"model.hf.router_jitter_noise: {jitter} draws different noise on tensor-parallel "
            f"peers, which must route their tokens alike (parallel.tp={tp}); use 0"
        )
