"""Python's garbage collection at step boundaries, the same step on every rank (``gc.every``).

Python collects reference cycles when allocations pass a threshold: at a point of its own,
different on every rank. In synchronous training a rank that pauses to collect holds up every
rank that waits for it (a pipeline stage's neighbours, its tensor-parallel partners, the
gradient all-reduce), and a full collection walks every object the process holds (a model's
modules, the framework's objects): 0.3-1.9 s per collection on the pipeline bench's ranks
(session 19). :class:`StepCollector`, a step-seam controller, turns the automatic collection
off at the first step and runs one full collection after every ``every``-th step, at the step
seam (outside the timed step): every rank collects at the same boundary, so the pause is paid
once, side by side, and never inside a step. Garbage in cycles then waits up to ``every``
steps; memory freed by reference counts (tensors, most objects) is freed at once as always.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class StepCollector:
    """Seam controller: automatic collection off from the first step; ``gc.collect()`` after
    steps ``every - 1``, ``2 * every - 1``, ... (numbered as the seam numbers them: the same on
    every rank); ``close()`` restores the collector as it found it.

    ``collected_s``: wall seconds of its collections so far; ``collections``: how many.
    """

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"gc.every: a collection every {every} steps; need >= 1")
        self.every = every
        self.collections = 0
        self.collected_s = 0.0
        self._was_enabled: bool | None = None  # None: not yet taken over

    def on_step_begin(self, step: int) -> None:
        if self._was_enabled is None:
            self._was_enabled = gc.isenabled()
        gc.disable()  # again each step: code between steps may have turned it back on

    def on_step_end(self, step: int, timing: Any) -> None:
        if (step + 1) % self.every:
            return
        started = time.perf_counter()
        gc.collect()
        self.collected_s += time.perf_counter() - started
        self.collections += 1

    def close(self) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
