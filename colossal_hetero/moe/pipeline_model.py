"""Whether a2a/expert pipelining pays, and over how many token ranges (pure: no torch).

Pipelining (moe/pipelined.py) cuts a block's dispatch and combine into ``n`` token ranges so
that range ``g``'s experts run while range ``g + 1`` is on the wire. It trades one a2a per
exchange for ``n``: every extra a2a costs its fixed latency ``alpha`` again, and the overlap
it buys is at most the expert compute. The model below predicts one block's exchange time
from measured inputs, the same on every rank:

- ``alpha`` (s) and ``beta`` (bytes/s): the all-to-all cost ``alpha + S / beta`` of ``S``
  bytes sent per rank on the ep group;
- ``rows`` dispatched per rank and ``row_bytes`` per row (the hidden state);
- ``fwd_row_s`` and ``bwd_row_s``: seconds of one expert row forward and backward.

All are measured inside real unpipelined training steps (:func:`step_measurements`, from the
step's a2a log): an a2a timed apart, after a barrier, costs a tenth of what the same call
costs inside a step on a shared machine (measured: 0.09 ms against about 1 ms of latency),
and a model fed with that predicts a gain that the step does not see.

One pass (forward, or backward with the backward compute) on a first-in-first-out wire and
one compute stream, as the pipelined block issues them: the ``n`` dispatch a2a's go at once
(``a = alpha + rows * row_bytes / (n * beta)`` each), range ``g``'s experts (``c = rows *
row_s / n``) start when its dispatch has arrived and range ``g - 1``'s experts are done, and
its combine a2a follows its experts once the wire is free. With ``n = 1`` that is ``2a + c``;
with ``n = 2`` and ``c / 2 <= a`` it is ``4 alpha + 2 rows * row_bytes / beta``: pipelining
pays only when the expert compute exceeds the extra latency.

The routing counts: a pipelined block exchanges them in an a2a of its own before its
dispatches (every range's counts at once), and so does an unpipelined block until it folds
them into its dispatch (moe/folded.py), which it does once the choice is made. With
``counts_folded`` the one-range block will fold, so every ``n > 1`` pays one more ``alpha``
per forward (the padding the folded dispatch carries is left out: at most ``MARGIN`` - 1 of
its rows). Session 10: without it the model proposed 2 ranges for a predicted 1.8-2.2 ms a
block, less than the counts a2a's ``alpha`` (1.5-3.7 ms), and the trial dropped them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

MIN_GAIN = 0.05
"""Relative gain over one range that a larger ``n`` must be predicted to bring (model error)
by default, and that a tried ``n`` must measure (moe/pipeline_choice.py)."""
PROPOSE_GAIN = 0.20
"""The predicted gain the runtime chooser (moe/pipeline_choice.py) asks before it proposes
``n > 1`` for a trial. Sessions 9-10: every trial (7, on emulated devices and shaped links) ran
the proposal 1.03-2.1× slower than one range for predicted gains of 5.1-18.5%, and a
variant that ran a trial then measured 0.87-1.00× of an identical one that did not."""


@dataclass(frozen=True, slots=True)
class ExchangeInputs:
    """Measured inputs of the model (see the module); all agreed over the world."""

    alpha: float
    beta: float
    rows: int
    row_bytes: int
    fwd_row_s: float
    bwd_row_s: float
    counts_folded: bool = False
    """Whether one range carries the routing counts inside its dispatch (see the module)."""

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta <= 0 or self.rows < 0 or self.row_bytes < 0:
            raise ValueError(f"pipeline model: invalid measured inputs {self}")
        if self.fwd_row_s < 0 or self.bwd_row_s < 0:
            raise ValueError(f"pipeline model: negative compute time in {self}")


def pass_time(n: int, alpha: float, beta: float, nbytes: float, compute: float) -> float:
    """Seconds of one pass (dispatch, experts, combine) over ``n`` ranges of ``nbytes`` sent
    and ``compute`` expert seconds in all (see the module)."""
    if n < 1:
        raise ValueError(f"pipeline model: n must be >= 1, got {n}")
    a, c = alpha + nbytes / (n * beta), compute / n
    wire = n * a  # every dispatch is issued before any combine
    computed = 0.0
    for g in range(n):
        computed = max((g + 1) * a, computed) + c
        wire = max(computed, wire) + a
    return wire


def exchange_time(n: int, inputs: ExchangeInputs) -> float:
    """Predicted seconds of one block's forward and backward exchanges over ``n`` ranges."""
    nbytes = inputs.rows * inputs.row_bytes
    forward = pass_time(n, inputs.alpha, inputs.beta, nbytes, inputs.rows * inputs.fwd_row_s)
    backward = pass_time(n, inputs.alpha, inputs.beta, nbytes, inputs.rows * inputs.bwd_row_s)
    counts = inputs.alpha if n > 1 and inputs.counts_folded else 0.0
    return forward + backward + counts


def choose_ranges(inputs: ExchangeInputs, most: int, margin: float = MIN_GAIN) -> tuple[int, dict]:
    """(ranges, record): the ``n`` in ``1..most`` with the least predicted exchange time,
    1 unless that beats one range by more than ``margin``; the record holds the inputs and
    each candidate's prediction (for the log)."""
    if most < 1:
        raise ValueError(f"pipeline model: most must be >= 1, got {most}")
    predicted = {n: exchange_time(n, inputs) for n in range(1, most + 1)}
    best = min(predicted, key=lambda n: (predicted[n], n))
    if predicted[best] > (1 - margin) * predicted[1]:
        best = 1
    record = {"ranges": best, "predicted_s": predicted, "inputs": asdict(inputs)}
    return best, record


def step_measurements(log: Sequence[Sequence[Any]], layers: int) -> list[float] | None:
    """``[alpha, seconds per byte, forward expert s, backward expert s]`` per block from one
    unpipelined step's log rows ``(kind, group, id, t_launch, t_done, nbytes)``; None unless
    the step issued the unpipelined ``5 * layers`` a2a's.

    The forward issues, per layer, the routing counts, dispatch and combine a2a's, and the
    backward the combine's and the dispatch's reverse: so the first ``3 * layers`` calls come
    in triples and the rest in pairs. ``alpha`` is the median time of the counts a2a's (a few
    bytes: latency only, as the step really pays it, peers' wake-ups included); the seconds
    per byte are the data a2a's total time beyond ``alpha`` each over their total bytes; the
    expert time of a pass is the mean gap from a dispatch's end to its combine's launch.
    """
    calls = sorted((row for row in log if row[0] == "a2a"), key=lambda row: row[3])
    if layers < 1 or len(calls) != 5 * layers:
        return None
    forward = [calls[3 * i : 3 * i + 3] for i in range(layers)]
    backward = [calls[3 * layers + 2 * i : 3 * layers + 2 * i + 2] for i in range(layers)]
    alpha = statistics.median(c[4] - c[3] for c, _, _ in forward)
    data = [call for _, *pair in forward for call in pair] + [c for pair in backward for c in pair]
    nbytes = sum(call[5] for call in data)
    beyond = sum(call[4] - call[3] for call in data) - alpha * len(data)
    per_byte = max(beyond, 0.0) / nbytes if nbytes else 0.0
    fwd = statistics.fmean(max(0.0, b[3] - a[4]) for _, a, b in forward)
    bwd = statistics.fmean(max(0.0, b[3] - a[4]) for a, b in backward)
    return [alpha, per_byte, fwd, bwd]
