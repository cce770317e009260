"""Samples per data-parallel group: even, explicit, or proportional to speed. Pure."""

from __future__ import annotations

from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.schema import HeteroConfig
from colossal_hetero.planner.rounding import round_widths


def group_speeds(config: HeteroConfig, world_size: int, dp_size: int) -> list[float]:
    """Speed of each data-parallel group: its slowest device's (the group moves in lockstep).

    Ranks are laid out dp-outermost: group ``g`` holds ranks ``[g * tp * pp, (g + 1) * tp * pp)``.
    """
    speeds = config.cluster.speeds(world_size)
    size = world_size // dp_size
    return [min(speeds[g * size : (g + 1) * size]) for g in range(dp_size)]


def batch_shares(
    config: HeteroConfig, world_size: int, dp_size: int, global_batch_size: int
) -> list[int]:
    """Samples each data-parallel group processes per step; sums to ``global_batch_size``.

    Shares are multiples of ``parallel.num_microbatches`` when pipelining (each micro-batch of
    a group has the same size). Raises ConfigError naming the field when impossible.
    """
    parallel = config.parallel
    # 0 micro-batches: planned per even share (config/parallel.py refuses uneven shares)
    granularity = (parallel.num_microbatches or 1) if parallel.pp > 1 else 1
    if parallel.batch_shares:
        shares = list(parallel.batch_shares)
        _check(shares, dp_size, global_batch_size, granularity, "parallel.batch_shares")
        return shares
    if parallel.batch_split == "even" or dp_size == 1:
        ratios = [1.0] * dp_size
    else:
        ratios = group_speeds(config, world_size, dp_size)
    units = global_batch_size // granularity
    if units * granularity != global_batch_size or units < dp_size:
        raise ConfigError(
            f"data.global_batch_size: {global_batch_size} samples cannot give each of "
            f"{dp_size} data-parallel groups whole micro-batches of {granularity}"
        )
    # Every group gets at least one micro-batch: round the rest in proportion to speed.
    extra = round_widths(units - dp_size, ratios)
    shares = [(1 + e) * granularity for e in extra]
    _check(shares, dp_size, global_batch_size, granularity, "parallel.batch_split")
    return shares


def _check(shares: list[int], dp_size: int, total: int, granularity: int, field: str) -> None:
    if len(shares) != dp_size:
        raise ConfigError(f"{field}: {len(shares)} shares for {dp_size} data-parallel groups")
    if sum(shares) != total:
        raise ConfigError(f"{field}: shares {shares} do not sum to data.global_batch_size {total}")
    if any(share % granularity for share in shares):
        raise ConfigError(
            f"{field}: shares {shares} are not multiples of parallel.num_microbatches "
            f"({granularity})"
        )
