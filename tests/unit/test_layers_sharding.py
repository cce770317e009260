"""Pure sharding arithmetic of the resizable layers: no process group needed."""

from __future__ import annotations

import pytest
import torch

from colossal_hetero.layers import merge_shards, shard_of


@pytest.mark.parametrize(
    ("widths", "num_parts", "dim"),
    [((3, 1), 1, 0), ((0, 4), 1, 1), ((2, 0, 2), 3, 1), ((1, 1), 3, 0), ((0, 0), 2, 0)],
)
def test_shard_then_merge_is_identity(widths, num_parts, dim):
    shape = [5, 5]
    shape[dim] = num_parts * sum(widths)
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    shards = [shard_of(full, dim, widths, rank, num_parts) for rank in range(len(widths))]
    for shard, width in zip(shards, widths, strict=True):
        assert shard.shape[dim] == num_parts * width
    assert torch.equal(merge_shards(shards, dim, widths, num_parts), full)


def test_fused_shard_takes_each_part_slice():
    # [Q | K | V], each 4 wide; rank 1 of widths (3, 1) holds Q[3], K[3], V[3].
    full = torch.arange(12.0)
    assert shard_of(full, 0, (3, 1), 1, num_parts=3).tolist() == [3.0, 7.0, 11.0]
    assert shard_of(full, 0, (3, 1), 0, num_parts=3).tolist() == [0, 1, 2, 4, 5, 6, 8, 9, 10]


def test_shard_rejects_wrong_size():
    with pytest.raises(ValueError, match="expected 3 x 4"):
        shard_of(torch.zeros(10), 0, (3, 1), 0, num_parts=3)
