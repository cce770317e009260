"""Training data that ships with Python and scikit-learn: byte-level text and 8x8 digits.

``build_data(data_cfg, arch)`` returns a ``DataBundle`` whose training stream is a pure
function of (seed, step), so a resumed run replays it exactly; ``shard_batch`` and
``split_microbatches`` cut a global batch for data-parallel ranks and pipeline micro-batches.
"""

from colossal_hetero.data.batch import (
    Batch,
    batch_size_of,
    shard_batch,
    shard_batch_by_shares,
    share_loss_scale,
    split_microbatches,
)
from colossal_hetero.data.build import (
    CAUSAL_LM_ARCHS,
    IMAGE_ARCHS,
    MASKED_LM_ARCHS,
    build_data,
    dataset_for,
    vocab_size_for,
)
from colossal_hetero.data.bundle import DataBundle, step_generator
from colossal_hetero.data.digits import DIGIT_IMAGE_SIZE, NUM_DIGIT_CLASSES, DigitsData
from colossal_hetero.data.text import (
    BERT_VOCAB_SIZE,
    IGNORE_INDEX,
    MASK_ID,
    MLM_MASK_FRACTION,
    TEXT_VOCAB_SIZE,
    TextData,
    load_pydoc_corpus,
    mask_tokens,
    split_corpus,
)

__all__ = [
    "BERT_VOCAB_SIZE",
    "CAUSAL_LM_ARCHS",
    "DIGIT_IMAGE_SIZE",
    "IGNORE_INDEX",
    "IMAGE_ARCHS",
    "MASKED_LM_ARCHS",
    "MASK_ID",
    "MLM_MASK_FRACTION",
    "NUM_DIGIT_CLASSES",
    "TEXT_VOCAB_SIZE",
    "Batch",
    "DataBundle",
    "DigitsData",
    "TextData",
    "batch_size_of",
    "build_data",
    "dataset_for",
    "load_pydoc_corpus",
    "mask_tokens",
    "shard_batch",
    "shard_batch_by_shares",
    "share_loss_scale",
    "split_corpus",
    "split_microbatches",
    "step_generator",
    "vocab_size_for",
]
