"""Checkpoint IO that keeps uneven tensor-parallel shards lossless."""

from colossal_hetero.checkpoint.io import HeteroCheckpointIO

__all__ = ["HeteroCheckpointIO"]
