"""Choosing the number of a2a/expert pipelining ranges from measured inputs, between steps.

With ``moe.pipeline_auto`` (the default) ``moe.pipeline_chunks`` is the most token ranges a
block may use; the blocks start with one. At the end of each of the first steps every rank
reads its own step log (:func:`.pipeline_model.step_measurements`: the a2a latency and
per-byte time as the step paid them, and the expert compute between dispatch and combine);
the first step is a warm-up and not used. After step ``DECIDE_AFTER`` every rank:

1. takes the median of its measured steps, and the rows one block dispatched (recorded in
   forward);
2. takes the world's maximum of each (one ``all_reduce``: the slowest rank sets the pace), so
   every rank feeds the same :class:`.pipeline_model.ExchangeInputs` to
   :func:`.pipeline_model.choose_ranges`;
3. sets the chosen number on every block.

The decision, its inputs and each candidate's prediction go into that step's ``moe`` log
record (``pipeline``). Collective: every rank calls :meth:`PipelineChooser.on_step_end` at
the same step boundaries. Without a measurement anywhere (no training forward yet, or steps
of several forwards) it stays at one range and tries again after the next step, until step
``GIVE_UP_AFTER``, where it records one range for good.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from colossal_hetero.moe.pipeline_model import ExchangeInputs, choose_ranges, step_measurements

DECIDE_AFTER = 2
"""The step after which the choice is made (steps 1..DECIDE_AFTER are measured)."""

GIVE_UP_AFTER = 10
"""The step after which, with no measured step anywhere, one range is kept for good."""


class PipelineChooser:
    """Sets ``pipeline_chunks`` of ``blocks`` once, from measured steps (see the module);
    ``record`` keeps the decision."""

    def __init__(self, blocks: Sequence[Any], most: int) -> None:
        self.blocks, self.most = list(blocks), most
        self.samples: list[list[float]] = []
        self.record: dict[str, Any] | None = None

    def on_step_end(self, step: int, log: Sequence[Sequence[Any]]) -> dict[str, Any] | None:
        """Measure ``log`` (this step's); after ``DECIDE_AFTER``, decide: the record then."""
        if self.record is not None or not self.blocks:
            return None
        measured = step_measurements(log, len(self.blocks)) if step >= 1 else None
        if measured is not None:
            self.samples.append(measured)
        if step < DECIDE_AFTER:
            return None
        mine = [statistics.median(column) for column in zip(*self.samples, strict=True)]
        rows = max(getattr(b, "dispatched_rows", 0) for b in self.blocks)
        values = [*(mine or [0.0] * 4), float(rows), float(bool(mine))]
        agreed = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        alpha, per_byte, fwd, bwd, rows_max, any_sample = agreed.tolist()
        if not any_sample or rows_max == 0:
            if step < GIVE_UP_AFTER:
                return None
            self.record = {"step": step, "ranges": 1, "reason": "no unpipelined step measured"}
            return self.record
        block = self.blocks[0]
        row_bytes = block.hidden_dim * next(block.experts[block.held[0]].parameters()).itemsize
        beta = 1.0 / per_byte if per_byte > 0 else float("inf")
        n_rows = int(rows_max)
        inputs = ExchangeInputs(alpha, beta, n_rows, row_bytes, fwd / n_rows, bwd / n_rows)
        ranges, record = choose_ranges(inputs, self.most)
        for b in self.blocks:
            b.pipeline_chunks = ranges
        self.record = {"step": step, **record, "measured_steps": len(self.samples)}
        return self.record
