"""Silence Colossal-AI's import-time warnings about optional CUDA kernels it cannot use.

Every rank prints them (apex, TensorNVMe), which buries progress bars and tables; only those
messages are filtered.
"""

from __future__ import annotations

import warnings

_OPTIONAL_KERNELS = ("Please install apex", "Please install the latest tensornvme")


def quiet_optional_kernel_warnings() -> None:
    """Filter the optional-kernel warnings in this process (call before importing colossalai)."""
    for pattern in _OPTIONAL_KERNELS:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
