"""Count customized TP shards as sharded in Colossal-AI's gradient-norm (all devices).

HybridParallelPlugin's optimizers compute the global gradient norm by summing squared norms
over the TP group and dividing the sum of every parameter that ``is_distributed_tensor`` says
is replicated by ``tp_size``. Parameters sharded through customized hooks (GPT-2's fused QKV
in stock Colossal-AI, every resizable layer here) are not ``is_distributed_tensor``, so their
contribution was divided by ``tp_size`` as if replicated: clipping (``parallel.max_norm``)
then used a wrong norm. The module's name binding is replaced by a predicate that also
accepts customized distributed tensors. Checked by tests/distributed/test_parity.py.
"""

from __future__ import annotations

from typing import Any

_MARK = "_colossal_hetero_grad_norm"


def _is_sharded(tensor: Any) -> bool:
    from colossalai.tensor.d_tensor.api import (
        is_customized_distributed_tensor,
        is_distributed_tensor,
    )

    return is_distributed_tensor(tensor) or is_customized_distributed_tensor(tensor)


def count_customized_shards_in_grad_norm() -> None:
    """Install the fix; idempotent."""
    from colossalai.booster.plugin import hybrid_parallel_plugin

    if getattr(hybrid_parallel_plugin, _MARK, False):
        return
    hybrid_parallel_plugin.is_distributed_tensor = _is_sharded
    setattr(hybrid_parallel_plugin, _MARK, True)
