"""Uneven data-parallel batch shares and the loss scale that keeps gradients exact."""

from __future__ import annotations

import pytest
import torch

from colossal_hetero.config import (
    ClusterConfig,
    ConfigError,
    DeviceSpec,
    HeteroConfig,
    ParallelConfig,
)
from colossal_hetero.data import shard_batch_by_shares, share_loss_scale
from colossal_hetero.planner.batch_shares import batch_shares, group_speeds


def _config(speeds, **parallel) -> HeteroConfig:
    devices = [DeviceSpec(speed=s) for s in speeds]
    return HeteroConfig(parallel=ParallelConfig(**parallel), cluster=ClusterConfig(devices=devices))


def test_group_speed_is_its_slowest_device():
    config = _config([1.0, 0.5, 1.0, 1.0], tp=2)
    assert group_speeds(config, world_size=4, dp_size=2) == [0.5, 1.0]


def test_speed_split_is_proportional_and_sums():
    config = _config([1.0, 0.5], batch_split="speed")
    assert batch_shares(config, 2, 2, 32) == [21, 11]  # 1 each + 30 split 2:1
    assert batch_shares(_config([1.0, 1.0], batch_split="speed"), 2, 2, 32) == [16, 16]


def test_speed_split_respects_microbatches():
    config = _config([1.0, 0.25, 1.0, 0.25], pp=2, num_microbatches=2, batch_split="speed")
    shares = batch_shares(config, 4, 2, 16)
    assert sum(shares) == 16 and all(s % 2 == 0 for s in shares)


def test_explicit_shares_are_checked():
    with pytest.raises(ConfigError, match=r"^parallel\.batch_shares: shares \[3, 3\] do not sum"):
        batch_shares(_config([1, 1], batch_shares=[3, 3]), 2, 2, 8)
    with pytest.raises(ConfigError, match=r"^parallel\.batch_shares: 1 shares for 2"):
        batch_shares(_config([1, 1], batch_shares=[8]), 2, 2, 8)


def test_too_small_a_batch_is_an_error():
    with pytest.raises(ConfigError, match=r"^data\.global_batch_size: 2 samples cannot give"):
        batch_shares(_config([1, 1, 1], batch_split="speed"), 3, 3, 2)


@pytest.mark.numerics
def test_weighted_mean_of_scaled_losses_is_the_global_mean():
    torch.manual_seed(0)
    losses = torch.rand(10)
    shares = [6, 3, 1]
    batch = {"x": losses}
    scaled = [
        shard_batch_by_shares(batch, shares, r)["x"].mean() * share_loss_scale(shares, r)
        for r in range(3)
    ]
    # Data parallelism averages over ranks.
    # float32, 3 terms summed in another order: <= 4 u |loss| ~ 2.4e-7 relative, inside
    # assert_close's float32 default (1.3e-6 relative + 1e-5).
    torch.testing.assert_close(sum(scaled) / 3, losses.mean())
