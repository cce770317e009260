"""Byte-level text from CPython's ``pydoc_data.topics``: causal and masked LM batches.

The corpus is every topic text, joined in sorted key order and UTF-8 encoded: one token per
byte, ids ``0..255``. It ships with CPython, so nothing is downloaded, but its exact content
follows the Python version (every rank of a run uses the same interpreter, so they agree).

Shapes (B samples, S = seq_len):
    input_ids, attention_mask, labels: int64 [B, S]; token_type_ids (masked LM only) [B, S]
"""

from __future__ import annotations

import torch

from colossal_hetero.data.batch import Batch
from colossal_hetero.data.bundle import (
    TRAIN_STREAM,
    VAL_STREAM,
    DataBundle,
    holdout_count,
    step_generator,
)

TEXT_VOCAB_SIZE = 256
"""Distinct byte tokens: ids ``0..255``."""

MASK_ID = 256
"""Token id that replaces masked positions in masked-LM batches (just past the bytes)."""

BERT_VOCAB_SIZE = 320
"""Vocabulary for bert on this data: >= ``MASK_ID + 1`` and divisible by 64 for TP splits."""

MLM_MASK_FRACTION = 0.15
"""Fraction of positions of each row that masked-LM batches mask."""

IGNORE_INDEX = -100
"""Label of positions that carry no loss (Hugging Face's convention)."""


def load_pydoc_corpus() -> torch.Tensor:
    """The whole corpus as bytes: uint8 ``[N]``, topics joined in sorted key order."""
    from pydoc_data.topics import topics

    text = "".join(topics[key] for key in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def split_corpus(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``tokens [N]`` into ``(train, val)``: val is the tail, ``ceil(N * fraction)`` long.

    The two parts are adjacent and disjoint: ``torch.cat([train, val])`` is ``tokens``.

    Raises:
        ValueError: ``val_fraction`` outside ``(0, 1)`` or either part would be empty.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    num_val = holdout_count(tokens.numel(), val_fraction)
    num_train = tokens.numel() - num_val
    if num_train < 1:
        raise ValueError(f"{tokens.numel()} tokens leave nothing to train on at {val_fraction}")
    return tokens[:num_train], tokens[num_train:]


def mask_tokens(
    input_ids: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked-LM corruption of ``input_ids [B, S]``: returns ``(masked_ids, labels)``.

    Each row masks exactly ``max(1, round(0.15 * S))`` positions, picked uniformly by
    ``generator``: ``masked_ids`` holds ``MASK_ID`` there and the input elsewhere; ``labels``
    holds the original id there and ``IGNORE_INDEX`` elsewhere. (Always ``MASK_ID``: no 80/10/10
    replacement, which needs no more vocabulary and changes nothing at this scale.)
    """
    num_rows, seq_len = input_ids.shape
    num_masked = max(1, round(MLM_MASK_FRACTION * seq_len))
    scores = torch.rand(num_rows, seq_len, generator=generator)
    positions = scores.topk(num_masked, dim=1).indices
    is_masked = torch.zeros(num_rows, seq_len, dtype=torch.bool)
    is_masked.scatter_(1, positions, True)
    masked_ids = input_ids.masked_fill(is_masked, MASK_ID)
    labels = input_ids.masked_fill(~is_masked, IGNORE_INDEX)
    return masked_ids, labels


class TextData(DataBundle):
    """Windows of ``seq_len`` bytes for causal LM (gpt2, llama) or masked LM (bert).

    Training batch ``k`` holds windows at offsets drawn uniformly (with replacement) from the
    training part; validation batch ``i`` holds the consecutive non-overlapping windows
    ``i * B .. (i + 1) * B - 1`` of the held-out tail, so no window crosses the split.

    Causal batches have ``labels == input_ids`` (the model shifts them). Masked batches come
    from ``mask_tokens`` and add ``token_type_ids`` (zeros); validation masks are fixed.
    """

    def __init__(
        self, tokens: torch.Tensor, *, seq_len: int, val_fraction: float, masked_lm: bool
    ) -> None:
        """Split ``tokens`` (int ``[N]``, ids ``< 256``) and check both parts fit a window.

        Raises:
            ValueError: ``seq_len < 2`` or a part is shorter than ``seq_len``.
        """
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.train_tokens, self.val_tokens = split_corpus(tokens, val_fraction)
        for name, part in (("training", self.train_tokens), ("validation", self.val_tokens)):
            if part.numel() < seq_len:
                raise ValueError(
                    f"the {name} text has {part.numel()} tokens, fewer than seq_len {seq_len}"
                )
        self.seq_len = seq_len
        self.masked_lm = masked_lm
        self.num_train_samples = self.train_tokens.numel() // seq_len
        self.num_val_samples = self.val_tokens.numel() // seq_len
        self.tokens_per_sample = seq_len

    def train_batch(self, step: int, batch_size: int, seed: int) -> Batch:
        """See ``DataBundle.train_batch``; windows start anywhere in the training part."""
        generator = step_generator(seed, TRAIN_STREAM, step)
        num_offsets = self.train_tokens.numel() - self.seq_len + 1
        offsets = torch.randint(num_offsets, (batch_size,), generator=generator)
        return self._batch(self.train_tokens, offsets, generator)

    def val_batch(self, index: int, batch_size: int) -> Batch:
        """See ``DataBundle.val_batch``."""
        first = index * batch_size
        if index < 0 or first + batch_size > self.num_val_samples:
            raise ValueError(
                f"validation batch {index} of {batch_size} runs past the "
                f"{self.num_val_samples} validation windows"
            )
        offsets = torch.arange(first, first + batch_size) * self.seq_len
        return self._batch(self.val_tokens, offsets, step_generator(0, VAL_STREAM, index))

    def _batch(self, part: torch.Tensor, offsets: torch.Tensor, gen: torch.Generator) -> Batch:
        positions = offsets[:, None] + torch.arange(self.seq_len)
        input_ids = part[positions].long()
        attention_mask = torch.ones_like(input_ids)
        if not self.masked_lm:
            return {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "labels": input_ids.clone(),
            }
        masked_ids, labels = mask_tokens(input_ids, gen)
        return {
            "input_ids": masked_ids,
            "attention_mask": attention_mask,
            "token_type_ids": torch.zeros_like(input_ids),
            "labels": labels,
        }
