"""Known third-party warnings are dropped at their source, and only there."""

from __future__ import annotations

import logging
import warnings

import pytest

from colossal_hetero.utils.quiet import DropMessage, quiet_third_party_warnings

BNB = "bitsandbytes.backends.cpu.ops"
BNB_TEXT = "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please install"
LLAMA = "colossalai.shardformer.modeling.llama"
CACHE_TEXT = "`use_cache=True` is incompatible with pipeline parallelism. Setting `use_cache=False`"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def restore_filters():
    names = (BNB, LLAMA, "transformers.modeling_utils", "colossal_hetero.probe")
    saved = {name: list(logging.getLogger(name).filters) for name in names}
    for name in names:  # start unfiltered: cli.main, run by other tests, installs them too
        logger = logging.getLogger(name)
        logger.filters[:] = [f for f in logger.filters if not isinstance(f, DropMessage)]
    with warnings.catch_warnings():
        yield
    for name, filters in saved.items():
        logging.getLogger(name).filters[:] = filters


def _emitted(logger_name: str, level: int, message: str, *args: object) -> list[str]:
    logger = logging.getLogger(logger_name)
    handler = _Collect()
    logger.addHandler(handler)
    try:
        logger.log(level, message, *args)
    finally:
        logger.removeHandler(handler)
    return handler.messages


def test_log_records_are_dropped_at_their_source_only(restore_filters):
    quiet_third_party_warnings()
    quiet_third_party_warnings()  # idempotent: one filter per message
    assert sum(isinstance(f, DropMessage) for f in logging.getLogger(BNB).filters) == 1
    assert _emitted(BNB, logging.WARNING, BNB_TEXT, "No module named 'kernels'") == []
    assert _emitted(LLAMA, logging.WARNING, CACHE_TEXT) == []
    # The same words from another module, or as an error, still show.
    assert _emitted("colossal_hetero.probe", logging.WARNING, CACHE_TEXT) == [CACHE_TEXT]
    assert len(_emitted(BNB, logging.ERROR, BNB_TEXT, "x")) == 1
    assert _emitted(BNB, logging.WARNING, "something else") == ["something else"]


def test_use_cache_notice_stays_with_a_pipeline(restore_filters):
    quiet_third_party_warnings(pipeline=True)
    assert _emitted(LLAMA, logging.WARNING, CACHE_TEXT) == [CACHE_TEXT]
    assert _emitted(BNB, logging.WARNING, BNB_TEXT, "x") == []


def test_transformers_loss_type_notice_from_the_real_model(restore_filters):
    """transformers 4.51 warns through ``logger.warning_once`` when a causal LM's config
    leaves loss_type unset; the property still returns the default loss."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    model.loss_type = None
    from transformers.utils import logging as hf_logging

    handler = _Collect()
    source = logging.getLogger("transformers.modeling_utils")
    source.addHandler(handler)
    try:
        hf_logging.get_logger("x").warning_once.cache_clear()  # once per process otherwise
        assert model.loss_function is not None
        heard = [m for m in handler.messages if "loss_type=None" in m]
        assert len(heard) == 1  # the real source says it, with the words the filter expects
        hf_logging.get_logger("x").warning_once.cache_clear()
        quiet_third_party_warnings()
        assert model.loss_function is not None
    finally:
        source.removeHandler(handler)
    assert [m for m in handler.messages if "loss_type=None" in m] == heard


def test_import_warnings_filtered_by_module_and_category(restore_filters):
    warnings.simplefilter("always")
    quiet_third_party_warnings()
    apex = "Please install apex from source (https://github.com/NVIDIA/apex) to use the kernel"
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn_explicit(
            apex, UserWarning, "normalization.py", 48, "colossalai.shardformer.layer.normalization"
        )
        warnings.warn_explicit(
            "Please install the latest tensornvme to use async save.",
            UserWarning,
            "safetensors.py",
            14,
            "colossalai.utils.safetensors",
        )
        warnings.warn_explicit(apex, UserWarning, "ours.py", 1, "colossal_hetero.ours")
        warnings.warn_explicit(
            apex,
            DeprecationWarning,
            "normalization.py",
            48,
            "colossalai.shardformer.layer.normalization",
        )
    assert [(w.filename, w.category) for w in caught] == [
        ("ours.py", UserWarning),
        ("normalization.py", DeprecationWarning),
    ]


_IMPORT_PROBE = """
import json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import colossalai.shardformer.layer.normalization, colossalai.utils.safetensors
notices = [w for w in caught if "Please install" in str(w.message)]
from colossal_hetero.utils.quiet import quiet_third_party_warnings
with warnings.catch_warnings(record=True) as again:
    warnings.simplefilter("always")
    quiet_third_party_warnings()
    for w in notices:  # re-issued from the module that issued it (named from its file)
        tail = w.filename.split("site-packages/")[-1].removesuffix(".py")
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, tail.replace("/", "."))
print(json.dumps({"before": [str(w.message) for w in notices], "after": len(again)}))
"""


def test_colossalai_import_warnings_from_the_real_modules():
    """Importing the two Colossal-AI modules issues the apex and TensorNVMe notices on this
    CPU stack (caught in a fresh interpreter); issued again from those modules with the
    filters installed, none gets through."""
    import json
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    before = " ".join(report["before"])
    assert "Please install apex" in before and "Please install the latest tensornvme" in before
    assert report["after"] == 0
