"""Pipeline schedules beyond 1F1B: the kFkB order (Ada-Grouper), its simulator and the k tuner.

``order``, ``simulator``, ``tuner`` and ``plot`` are pure (no torch.distributed): every rank can
evaluate them locally on identical inputs and reach the same decision.
"""

from colossal_hetero.pipeline.order import kfkb_order
from colossal_hetero.pipeline.simulator import SimResult, Trace, simulate

__all__ = ["SimResult", "Trace", "kfkb_order", "simulate"]
