"""The interface every data source implements, and its deterministic seeding.

Determinism contract: training batch ``k`` is a pure function of ``(seed, k, batch_size)``,
drawn from a local ``torch.Generator`` seeded from those values. The global RNG is never read
or advanced, so resuming at step ``k`` replays exactly the stream a run from step 0 would have
produced from step ``k`` on, and every rank that asks for the same step gets the same batch.
"""

from __future__ import annotations

import abc
import itertools
import math
from collections.abc import Iterator

import numpy as np
import torch

from colossal_hetero.data.batch import Batch

TRAIN_STREAM = 0
"""Generator stream of training batches."""

VAL_STREAM = 1
"""Generator stream of validation randomness (masking), independent of the data seed."""


def step_generator(seed: int, stream: int, index: int) -> torch.Generator:
    """A fresh CPU generator for one (seed, stream, index) triple.

    The three values go through numpy's ``SeedSequence``, so nearby seeds and indices give
    unrelated streams.

    Raises:
        ValueError: any of the values is negative.
    """
    if min(seed, stream, index) < 0:
        raise ValueError(
            f"seed, stream and index must be >= 0, got seed={seed}, stream={stream}, index={index}"
        )
    state = np.random.SeedSequence([seed, stream, index]).generate_state(1, dtype=np.uint64)
    generator = torch.Generator()
    generator.manual_seed(int(state[0]))
    return generator


def holdout_count(num_items: int, val_fraction: float) -> int:
    """How many of ``num_items`` are held out for validation: ``ceil(num_items * fraction)``."""
    return math.ceil(num_items * val_fraction)


class DataBundle(abc.ABC):
    """Training and validation data of one run, ready for one model family.

    Subclasses implement ``train_batch`` and ``val_batch``; iteration is built on them.

    Attributes:
        num_train_samples: Training samples in one pass over the training data.
        num_val_samples: Validation samples available to ``val_batches``.
        tokens_per_sample: Tokens per sample for text data (``seq_len``), None for images.
    """

    num_train_samples: int
    num_val_samples: int
    tokens_per_sample: int | None

    @abc.abstractmethod
    def train_batch(self, step: int, batch_size: int, seed: int) -> Batch:
        """Global training batch of step ``step``: ``batch_size`` samples, deterministic."""

    @abc.abstractmethod
    def val_batch(self, index: int, batch_size: int) -> Batch:
        """Validation batch ``index`` (samples ``[index * B, (index + 1) * B)``).

        Raises:
            ValueError: the batch would run past the validation data.
        """

    def train_batches(self, batch_size: int, seed: int, start_step: int = 0) -> Iterator[Batch]:
        """Endless training batches of steps ``start_step, start_step + 1, ...``.

        Item ``i`` is ``train_batch(start_step + i, batch_size, seed)``, so starting at step
        ``k`` yields what starting at 0 yields after skipping ``k`` batches.

        Raises:
            ValueError: ``batch_size < 1``, or ``seed`` or ``start_step`` negative.
        """
        _check_batch_size(batch_size)
        if start_step < 0 or seed < 0:
            raise ValueError(f"seed and start_step must be >= 0, got {seed} and {start_step}")
        return (self.train_batch(step, batch_size, seed) for step in itertools.count(start_step))

    def val_batches(self, batch_size: int, num_batches: int) -> list[Batch]:
        """The first ``num_batches`` validation batches; the same on every call and rank.

        Raises:
            ValueError: they need more than ``num_val_samples`` samples.
        """
        _check_batch_size(batch_size)
        if num_batches > self.max_val_batches(batch_size):
            raise ValueError(
                f"{num_batches} validation batches of {batch_size} need "
                f"{num_batches * batch_size} samples, but only {self.num_val_samples} are held "
                "out; lower the number of validation batches or the batch size"
            )
        return [self.val_batch(i, batch_size) for i in range(num_batches)]

    def max_val_batches(self, batch_size: int) -> int:
        """How many distinct validation batches of ``batch_size`` there are."""
        _check_batch_size(batch_size)
        return self.num_val_samples // batch_size


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
