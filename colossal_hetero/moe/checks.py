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
    if parallel.tp > 1 or parallel.pp > 1:
        raise ConfigError(
            f"parallel.ep: expert parallelism runs with tp = pp = 1 so far, got tp={parallel.tp} "
            f"pp={parallel.pp}"
        )
    if world_size % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the world size ({world_size})")
    dp = parallel.dp or world_size
    if dp % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the data-parallel size ({dp})")
    if moe.replace_every and (parallel.zero_stage or parallel.precision != "fp32"):
        # ZeRO and mixed precision keep master copies and flat buffers moe/replace.py does not
        # move: a re-placement would train the moved experts from stale masters.
        raise ConfigError(
            f"moe.replace_every: re-placement moves fp32 weights and optimizer state, so it "
            f"needs parallel.zero_stage 0 and precision fp32, got zero_stage="
            f"{parallel.zero_stage} precision={parallel.precision}"
        )
    if moe.placement and len(moe.placement) != ep:
        raise ConfigError(
            f"moe.placement: lists {len(moe.placement)} expert-parallel ranks, parallel.ep is {ep}"
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
