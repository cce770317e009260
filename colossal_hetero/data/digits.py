"""scikit-learn's 8x8 handwritten digits (1797 images, 10 classes) as image batches.

Shapes (B samples):
    pixel_values: float32 [B, 1, 8, 8], normalised by the training pixels' mean and std
    labels: int64 [B], class ids 0..9
"""

from __future__ import annotations

import torch

from colossal_hetero.data.batch import Batch
from colossal_hetero.data.bundle import TRAIN_STREAM, DataBundle, holdout_count, step_generator

NUM_DIGIT_CLASSES = 10
"""Classes of the digits data."""

DIGIT_IMAGE_SIZE = 8
"""Height and width of a digit image, pixels."""

SPLIT_SEED = 0
"""Seed of the train/validation split: fixed, so every run validates on the same images."""


def load_digits_split(
    val_fraction: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw digits split ``(train_x, train_y, val_x, val_y)``, stratified by class.

    ``x`` is float32 ``[N, 1, 8, 8]`` with values 0..16, ``y`` int64 ``[N]``. The validation
    part has ``ceil(1797 * val_fraction)`` images, chosen with ``SPLIT_SEED``.

    Raises:
        ValueError: ``val_fraction`` outside ``(0, 0.5]``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if not 0.0 < val_fraction <= 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5], got {val_fraction}")
    digits = load_digits()
    images = digits.images.reshape(-1, 1, DIGIT_IMAGE_SIZE, DIGIT_IMAGE_SIZE)
    train_x, val_x, train_y, val_y = train_test_split(
        images,
        digits.target,
        test_size=holdout_count(len(images), val_fraction),
        random_state=SPLIT_SEED,
        stratify=digits.target,
    )
    return (
        torch.as_tensor(train_x, dtype=torch.float32),
        torch.as_tensor(train_y, dtype=torch.long),
        torch.as_tensor(val_x, dtype=torch.float32),
        torch.as_tensor(val_y, dtype=torch.long),
    )


class DigitsData(DataBundle):
    """Digits for an image classifier (vit).

    Training batches walk through epochs: epoch ``e`` is a permutation of the training images
    drawn from ``(seed, e)``, and step ``k`` takes positions ``[k * B, (k + 1) * B)`` of the
    concatenated epochs, so every image is seen once per epoch. Validation batch ``i`` holds
    validation images ``[i * B, (i + 1) * B)`` in a fixed order.
    """

    def __init__(self, val_fraction: float) -> None:
        """Load, split and normalise (one mean and std over all training pixels)."""
        train_x, self.train_labels, val_x, self.val_labels = load_digits_split(val_fraction)
        self.pixel_mean = float(train_x.mean())
        self.pixel_std = float(train_x.std())
        self.train_pixels = (train_x - self.pixel_mean) / self.pixel_std
        self.val_pixels = (val_x - self.pixel_mean) / self.pixel_std
        self.num_train_samples = len(self.train_labels)
        self.num_val_samples = len(self.val_labels)
        self.tokens_per_sample = None

    def train_batch(self, step: int, batch_size: int, seed: int) -> Batch:
        """See ``DataBundle.train_batch``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        num_images = self.num_train_samples
        positions = torch.arange(step * batch_size, (step + 1) * batch_size)
        epochs = positions // num_images
        indices = torch.empty(batch_size, dtype=torch.long)
        for epoch in epochs.unique().tolist():
            order = torch.randperm(num_images, generator=step_generator(seed, TRAIN_STREAM, epoch))
            in_epoch = epochs == epoch
            indices[in_epoch] = order[positions[in_epoch] % num_images]
        return {"pixel_values": self.train_pixels[indices], "labels": self.train_labels[indices]}

    def val_batch(self, index: int, batch_size: int) -> Batch:
        """See ``DataBundle.val_batch``."""
        first = index * batch_size
        if index < 0 or first + batch_size > self.num_val_samples:
            raise ValueError(
                f"validation batch {index} of {batch_size} runs past the "
                f"{self.num_val_samples} validation images"
            )
        rows = slice(first, first + batch_size)
        return {
            "pixel_values": self.val_pixels[rows].clone(),
            "labels": self.val_labels[rows].clone(),
        }
