"""Batches as dicts of tensors, and the two ways to cut one: by data-parallel rank and into
micro-batches.

A batch maps names (``input_ids``, ``labels``, ``pixel_values``, ...) to tensors whose first
dimension is the sample dimension ``B``; every tensor of a batch has the same ``B``.
"""

from __future__ import annotations

import torch

Batch = dict[str, torch.Tensor]
"""A batch: field name -> tensor of shape ``[B, ...]``."""


def batch_size_of(batch: Batch) -> int:
    """Number of samples (rows) in ``batch``.

    Raises:
        ValueError: the batch is empty or its tensors disagree on the first dimension.
    """
    sizes = {name: tensor.shape[0] for name, tensor in batch.items()}
    if not sizes:
        raise ValueError("the batch has no tensors")
    if len(set(sizes.values())) != 1:
        raise ValueError(f"the batch's tensors disagree on the sample dimension: {sizes}")
    return next(iter(sizes.values()))


def shard_batch(batch: Batch, dp_rank: int, dp_size: int) -> Batch:
    """This data-parallel rank's contiguous rows of a global batch.

    Rank ``r`` of ``dp_size`` gets rows ``[r * B / dp_size, (r + 1) * B / dp_size)``. The
    result holds views of ``batch``'s tensors (no copy).

    Raises:
        ValueError: ``dp_size < 1``, ``dp_rank`` outside ``[0, dp_size)``, or ``B`` not
            divisible by ``dp_size``.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    num_samples = batch_size_of(batch)
    if num_samples % dp_size != 0:
        raise ValueError(
            f"a batch of {num_samples} samples does not split evenly over {dp_size} "
            "data-parallel ranks"
        )
    per_rank = num_samples // dp_size
    start = dp_rank * per_rank
    return {name: tensor[start : start + per_rank] for name, tensor in batch.items()}


def split_microbatches(batch: Batch, num_microbatches: int) -> list[Batch]:
    """Cut ``batch`` into ``num_microbatches`` equal, consecutive micro-batches.

    Micro-batch ``i`` holds rows ``[i * B / M, (i + 1) * B / M)`` as views (no copy).

    Raises:
        ValueError: ``num_microbatches < 1`` or ``B`` not divisible by it.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    num_samples = batch_size_of(batch)
    if num_samples % num_microbatches != 0:
        raise ValueError(
            f"a batch of {num_samples} samples does not split into {num_microbatches} "
            "equal micro-batches"
        )
    return [shard_batch(batch, i, num_microbatches) for i in range(num_microbatches)]
