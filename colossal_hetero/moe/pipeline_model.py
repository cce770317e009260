"""Whether a2a/expert pipelining pays, and over how many token ranges (pure: no torch).

Pipelining (moe/pipelined.py) cuts a block's dispatch and combine into ``n`` token ranges so
that range ``g``'s experts run while range ``g + 1`` is on the wire. It trades one a2a per
exchange for ``n``: every extra a2a costs its fixed latency ``alpha`` again, and the overlap
it buys is at most the expert compute. The model below predicts one block's exchange time
from measured inputs, the same on every rank:

- ``alpha`` (s) and ``beta`` (bytes/s): the all-to-all cost ``alpha + S / beta`` of ``S``
  bytes sent per rank on the ep group (moe/profile.py, agreed over the world);
- ``rows`` dispatched per rank and ``row_bytes`` per row (the hidden state);
- ``fwd_row_s`` and ``bwd_row_s``: seconds of one expert row forward and backward, measured
  on a held expert (agreed over the world).

One pass (forward, or backward with the backward compute) on a first-in-first-out wire and
one compute stream, as the pipelined block issues them: the ``n`` dispatch a2a's go at once
(``a = alpha + rows * row_bytes / (n * beta)`` each), range ``g``'s experts (``c = rows *
row_s / n``) start when its dispatch has arrived and range ``g - 1``'s experts are done, and
its combine a2a follows its experts once the wire is free. With ``n = 1`` that is ``2a + c``;
with ``n = 2`` and ``c / 2 <= a`` it is ``4 alpha + 2 rows * row_bytes / beta``: pipelining
pays only when the expert compute exceeds the extra latency.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

MIN_GAIN = 0.05
"""Relative gain over one range that a larger ``n`` must be predicted to bring (model error)."""


@dataclass(frozen=True, slots=True)
class ExchangeInputs:
    """Measured inputs of the model (see the module); all agreed over the world."""

    alpha: float
    beta: float
    rows: int
    row_bytes: int
    fwd_row_s: float
    bwd_row_s: float

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
    return forward + backward


def choose_ranges(inputs: ExchangeInputs, most: int) -> tuple[int, dict]:
    """(ranges, record): the ``n`` in ``1..most`` with the least predicted exchange time,
    1 unless that beats one range by more than ``MIN_GAIN``; the record holds the inputs and
    each candidate's prediction (for the log)."""
    if most < 1:
        raise ValueError(f"pipeline model: most must be >= 1, got {most}")
    predicted = {n: exchange_time(n, inputs) for n in range(1, most + 1)}
    best = min(predicted, key=lambda n: (predicted[n], n))
    if predicted[best] > (1 - MIN_GAIN) * predicted[1]:
        best = 1
    record = {"ranges": best, "predicted_s": predicted, "inputs": asdict(inputs)}
    return best, record
