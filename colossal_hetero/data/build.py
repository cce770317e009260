"""Pick and build the data source for a model family."""

from __future__ import annotations

from colossal_hetero.config.schema import DataConfig
from colossal_hetero.data.bundle import DataBundle
from colossal_hetero.data.digits import DigitsData
from colossal_hetero.data.text import BERT_VOCAB_SIZE, TEXT_VOCAB_SIZE, TextData, load_pydoc_corpus

CAUSAL_LM_ARCHS = ("gpt2", "llama", "mixtral")
"""Families trained as causal LMs on ``pydoc_topics``."""

MASKED_LM_ARCHS = ("bert",)
"""Families trained as masked LMs on ``pydoc_topics``."""

IMAGE_ARCHS = ("vit",)
"""Families trained as image classifiers on ``digits``."""


def dataset_for(arch: str) -> str:
    """The ``DataConfig.dataset`` a model family trains on.

    Raises:
        ValueError: unknown ``arch``.
    """
    if arch in CAUSAL_LM_ARCHS or arch in MASKED_LM_ARCHS:
        return "pydoc_topics"
    if arch in IMAGE_ARCHS:
        return "digits"
    raise ValueError(f"unknown model arch {arch!r}; expected gpt2, llama, bert or vit")


def vocab_size_for(arch: str) -> int:
    """Vocabulary size a text model family should use on this data.

    256 bytes for causal LMs; ``BERT_VOCAB_SIZE`` for bert, whose ``MASK_ID`` is 256.

    Raises:
        ValueError: ``arch`` is not a text model family.
    """
    if dataset_for(arch) != "pydoc_topics":
        raise ValueError(f"model arch {arch!r} does not take text, so it has no vocabulary")
    return BERT_VOCAB_SIZE if arch in MASKED_LM_ARCHS else TEXT_VOCAB_SIZE


def build_data(data_cfg: DataConfig, arch: str) -> DataBundle:
    """The data of a run: text windows for gpt2/llama/bert, digit images for vit.

    Raises:
        ValueError: ``data_cfg.dataset`` does not fit ``arch``, or the data is too small for
            ``seq_len``.
    """
    expected = dataset_for(arch)
    if data_cfg.dataset != expected:
        raise ValueError(
            f"data.dataset {data_cfg.dataset!r} does not fit model arch {arch!r} "
            f"(it trains on {expected!r})"
        )
    if expected == "digits":
        return DigitsData(data_cfg.val_fraction)
    return TextData(
        load_pydoc_corpus(),
        seq_len=data_cfg.seq_len,
        val_fraction=data_cfg.val_fraction,
        masked_lm=arch in MASKED_LM_ARCHS,
    )
