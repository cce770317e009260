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


def shard_batch_by_shares(batch: Batch, shares: list[int], dp_rank: int) -> Batch:
    """Data-parallel rank ``dp_rank``'s rows when ranks take uneven ``shares`` of the batch.

    Rank ``r`` gets rows ``[sum(shares[:r]), sum(shares[:r + 1]))`` as views. Pair it with
    ``share_loss_scale`` so that the data-parallel gradient mean stays the global-batch mean.

    Raises:
        ValueError: ``shares`` do not sum to the batch size, one is negative, or ``dp_rank``
            is out of range.
    """
    if not 0 <= dp_rank < len(shares):
        raise ValueError(f"dp_rank must be in [0, {len(shares)}), got {dp_rank}")
    if any(share < 0 for share in shares):
        raise ValueError(f"batch shares must be >= 0, got {shares}")
    num_samples = batch_size_of(batch)
    if sum(shares) != num_samples:
        raise ValueError(f"batch shares {shares} do not sum to the batch size {num_samples}")
    start = sum(shares[:dp_rank])
    return {name: tensor[start : start + shares[dp_rank]] for name, tensor in batch.items()}


def share_loss_scale(shares: list[int], dp_rank: int) -> float:
    """Factor for rank ``dp_rank``'s mean loss so that data parallelism's gradient *mean* over
    ``len(shares)`` ranks equals the gradient of the mean loss over the whole batch.

    With per-rank mean losses ``L_r`` over ``n_r`` samples, the global mean is
    ``sum_r n_r L_r / N``; the all-reduce divides by ``dp``, so rank ``r`` scales by
    ``dp * n_r / N``. Equal shares give 1.
    """
    return len(shares) * shares[dp_rank] / sum(shares)
