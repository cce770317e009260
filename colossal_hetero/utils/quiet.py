"""Filter known third-party warnings at their source, by category and module.

Every rank prints them, which buries progress bars and tables. Each filter names the module
that emits the message and the message's opening words, so the same text from anywhere else,
our own output included, still shows. What is filtered and why:

- ``colossalai.shardformer.layer.normalization``, ``colossalai.utils.safetensors``
  (``UserWarning`` at import): optional GPU kernels (apex, TensorNVMe) that CPU runs and
  synchronous checkpoints never use.
- ``colossalai.moe._operation`` (``FutureWarning`` at import): its MoE autograd ops use the
  GPU backend's deprecated ``amp.custom_fwd`` (``utils.device.DEPRECATED_AMP_WARNING``);
  nothing to act on for a user.
- ``bitsandbytes.backends.cpu.ops`` (log record, WARNING): a 4-bit CPU kernel from the
  ``kernels`` package; nothing here quantizes to 4 bits.
- ``transformers.modeling_utils`` (log record, WARNING): ``loss_type=None ... unrecognised``;
  transformers 4.51 says so for every causal LM whose config leaves ``loss_type`` unset, and
  then uses the right default loss.
- ``colossalai.shardformer.modeling.llama`` (log record, WARNING): ``use_cache=True is
  incompatible with pipeline parallelism``, printed by the Llama forward Colossal-AI runs for
  tensor parallelism too; filtered only when the run has no pipeline.
"""

from __future__ import annotations

import logging
import os
import warnings

from colossal_hetero.utils.device import DEPRECATED_AMP_WARNING

_IMPORT_WARNINGS = (
    (r"colossalai\.shardformer\.layer\.normalization", r"Please install apex"),
    (r"colossalai\.utils\.safetensors", r"Please install the latest tensornvme"),
)
# FutureWarning at import: Colossal-AI's MoE ops still use the deprecated amp decorators.
_IMPORT_FUTURE_WARNINGS = ((r"colossalai\.moe\._operation", DEPRECATED_AMP_WARNING),)
_LOG_RECORDS = (
    (
        "bitsandbytes.backends.cpu.ops",
        "Failed to load CPU gemm_4bit_forward from kernels-community",
    ),
    (
        "transformers.modeling_utils",
        "`loss_type=None` was set in the config but it is unrecognised",
    ),
    # With the optional deepspeed extra installed, importing transformers' models imports
    # DeepSpeed, whose accelerator probe reports a CPU-only host (a fact, not a problem).
    ("DeepSpeed", "Setting accelerator to CPU"),
)
_NO_PIPELINE_RECORDS = (
    (
        "colossalai.shardformer.modeling.llama",
        "`use_cache=True` is incompatible with pipeline parallelism",
    ),
)


class DropMessage(logging.Filter):
    """Drop WARNING-or-lower records whose message starts with ``prefix`` (errors still show)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.WARNING or not record.getMessage().startswith(self.prefix)


def _drop(logger_name: str, prefix: str) -> None:
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, DropMessage) and f.prefix == prefix for f in logger.filters):
        logger.addFilter(DropMessage(prefix))


def quiet_third_party_warnings(*, pipeline: bool = False) -> None:
    """Install the filters above in this process; idempotent.

    Call before importing colossalai (its import-time warnings) and before building models.
    ``pipeline``: whether the run uses pipeline parallelism (then the ``use_cache`` notice
    is true and stays).
    """
    for module, message in _IMPORT_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
    for module, message in _IMPORT_FUTURE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=module)
    records = _LOG_RECORDS if pipeline else _LOG_RECORDS + _NO_PIPELINE_RECORDS
    for logger_name, prefix in records:
        _drop(logger_name, prefix)


def quiet_optional_kernel_warnings() -> None:
    """Former name of :func:`quiet_third_party_warnings`; keeps the pipeline notice."""
    quiet_third_party_warnings(pipeline=True)


def no_idle_compile_workers() -> None:
    """Keep torch from starting its pool of Inductor compile workers in this process.

    Importing Colossal-AI imports ``torch._inductor``, which forks a warm pool of compile
    workers (about 0.5 GB and some CPU each time, per rank) that nothing here uses: no code
    path calls ``torch.compile``. Sets ``TORCH_WARM_POOL=0`` unless the user set it; child
    processes (spawned ranks, torchrun workers) inherit it. Call before importing colossalai.
    """
    os.environ.setdefault("TORCH_WARM_POOL", "0")
