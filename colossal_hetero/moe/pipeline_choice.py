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

The model proposes more than one range only if it predicts them ``PROPOSE_GAIN`` (20%) ahead
of one range: in session 10 every trial of a smaller predicted gain ran slower, and the
variant that ran it stayed slower than an identical one that never did (docs/moe.md).

A choice of more than one range is a proposal until measured steps confirm it: the model's
inputs come from unpipelined steps, and on a loaded host (or emulated devices) the ranges'
a2a's, issued together, cost more than it predicts. The next ``2 * TRIAL_STEPS`` steps
alternate the proposal and one range (each step's ``step_s``, the seam's step time); then the
world's maximum of each setting's median decides (one ``all_reduce``): the ranges are kept
only if they ran more than ``MIN_GAIN`` faster (the model's own margin; a quiet run's trial
measured 2 ranges 2% ahead in 3 early steps each, and they ran 18% behind one range after).
Without step times (``step_s`` None) the proposal is kept untried.

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

from colossal_hetero.moe.folded import header_fits
from colossal_hetero.moe.pipeline_model import (
    MIN_GAIN,
    PROPOSE_GAIN,
    ExchangeInputs,
    choose_ranges,
    step_measurements,
)
from colossal_hetero.utils.collectives import all_reduce_anywhere

DECIDE_AFTER = 2
"""The step after which the choice is made (steps 1..DECIDE_AFTER are measured)."""

TRIAL_STEPS = 3
"""Steps run at the proposed ranges, and at one range, before a proposal is kept or dropped."""

GIVE_UP_AFTER = 10
"""The step after which, with no measured step anywhere, one range is kept for good."""


class PipelineChooser:
    """Sets ``pipeline_chunks`` of ``blocks`` once, from measured steps (see the module);
    ``record`` keeps the decision."""

    def __init__(self, blocks: Sequence[Any], most: int) -> None:
        self.blocks, self.most = list(blocks), most
        self.samples: list[list[float]] = []
        self.record: dict[str, Any] | None = None
        self.proposal: dict[str, Any] | None = None
        """The model's choice of more than one range while its trial runs."""
        self.trial_s: dict[int, list[float]] = {}

    @property
    def measuring(self) -> bool:
        """Whether the unpipelined steps' a2a's are still being measured (no model choice)."""
        return self.record is None and self.proposal is None

    def on_step_end(
        self, step: int, log: Sequence[Sequence[Any]], step_s: float | None = None
    ) -> dict[str, Any] | None:
        """Measure ``log`` (this step's; ``step_s`` its seconds); after ``DECIDE_AFTER``,
        decide (a proposal of several ranges after its trial): the record then."""
        if self.record is not None or not self.blocks:
            return None
        if self.proposal is not None:
            return self._trial_step(step, step_s)
        measured = step_measurements(log, len(self.blocks)) if step >= 1 else None
        if measured is not None:
            self.samples.append(measured)
        if step < DECIDE_AFTER:
            return None
        record = self._model_choice(step)
        if record is None or record["ranges"] == 1 or step_s is None:
            return self._decide(record, step) if record is not None else None
        self.proposal = record
        self.trial_s = {record["ranges"]: [], 1: []}
        self._set(record["ranges"])  # the trial's first step runs the proposal
        return None

    def _model_choice(self, step: int) -> dict[str, Any] | None:
        """The pure model's choice from the agreed measurements (collective), or None."""
        mine = [statistics.median(column) for column in zip(*self.samples, strict=True)]
        rows = max(getattr(b, "dispatched_rows", 0) for b in self.blocks)
        values = [*(mine or [0.0] * 4), float(rows), float(bool(mine))]
        agreed = torch.tensor(values, dtype=torch.float64)
        all_reduce_anywhere(agreed, dist.ReduceOp.MAX)
        alpha, per_byte, fwd, bwd, rows_max, any_sample = agreed.tolist()
        if not any_sample or rows_max == 0:
            if step < GIVE_UP_AFTER:
                return None
            return {"step": step, "ranges": 1, "reason": "no unpipelined step measured"}
        block = self.blocks[0]
        row_bytes = block.hidden_dim * next(block.experts[block.held[0]].parameters()).itemsize
        beta = 1.0 / per_byte if per_byte > 0 else float("inf")
        n_rows = int(rows_max)
        # Folding blocks drop the counts a2a at one range only (pipeline_model.py).
        folds = all(getattr(b, "fold_counts", False) for b in self.blocks)
        folds = folds and header_fits(row_bytes, block.device_sizes)
        inputs = ExchangeInputs(
            alpha, beta, n_rows, row_bytes, fwd / n_rows, bwd / n_rows, counts_folded=folds
        )
        ranges, record = choose_ranges(inputs, self.most, margin=PROPOSE_GAIN)
        return {"step": step, **record, "ranges": ranges, "measured_steps": len(self.samples)}

    def _trial_step(self, step: int, step_s: float | None) -> dict[str, Any] | None:
        """Book the step that just ran; alternate the settings; decide after the trial."""
        assert self.proposal is not None
        ran = self.blocks[0].pipeline_chunks
        self.trial_s[ran].append(float("nan") if step_s is None else step_s)
        if any(len(times) < TRIAL_STEPS for times in self.trial_s.values()):
            self._set(1 if ran != 1 else self.proposal["ranges"])
            return None
        proposed = self.proposal["ranges"]
        medians = [statistics.median(self.trial_s[proposed]), statistics.median(self.trial_s[1])]
        agreed = torch.tensor(medians, dtype=torch.float64)
        all_reduce_anywhere(agreed, dist.ReduceOp.MAX)  # the slowest rank sets the pace
        proposed_s, one_s = agreed.tolist()
        kept = proposed_s < (1.0 - MIN_GAIN) * one_s  # the model's own margin, measured
        trial = {"steps": TRIAL_STEPS, "proposed_s": proposed_s, "one_range_s": one_s}
        record = {**self.proposal, "ranges": proposed if kept else 1, "trial": trial}
        return self._decide(record, step)

    def _decide(self, record: dict[str, Any], step: int) -> dict[str, Any]:
        record = {**record, "decided_at": step}
        self._set(record["ranges"])
        self.record = record
        return record

    def _set(self, ranges: int) -> None:
        for b in self.blocks:
            b.pipeline_chunks = ranges
