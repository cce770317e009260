"""The ``gc`` section of the configuration tree (Python's garbage collection in training).

A part of ``config.schema``, kept in its own module for size; documented in ``docs/config.md``
like every other section. The controller is ``colossal_hetero.utils.collector.StepCollector``.
"""

from __future__ import annotations

from dataclasses import dataclass

from colossal_hetero.config.fields import require as _require


@dataclass(kw_only=True, slots=True, frozen=True)
class CollectorConfig:
    """When Python collects garbage cycles during training (docs/architecture.md, "Step
    seam"). Python's own collector runs at allocation thresholds, a different moment on
    every rank; a rank collecting pauses every rank that waits for it (a full collection:
    up to seconds in a large process)."""

    every: int = 0
    """0: Python's automatic collection, as without the plugin. N > 0: automatic collection
    off from the first training step; one full collection on every rank after every N-th
    step, at the step boundary (outside the step's time), so all ranks pause together and
    never inside a step. Cyclic garbage then waits up to N steps (tensors are freed by
    reference counts at once, as always)."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, "every", f"must be >= 0, got {self.every}")
