"""The timing of one step, as the interceptor measures it. Pure data."""

from __future__ import annotations

from dataclasses import dataclass, field

COMM_KINDS: tuple[str, ...] = ("all_reduce", "all_to_all", "p2p", "other")
"""The kinds per-kind metrics are kept for: all-reduce; all-to-all (list or single); p2p
(send, recv, isend, irecv, batch_isend_irecv); other (gathers, scatters, broadcast, reduce,
barrier and the object collectives)."""


def zero_by_kind() -> dict[str, float]:
    """A per-kind counter with every kind of ``COMM_KINDS`` at 0."""
    return dict.fromkeys(COMM_KINDS, 0.0)


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Where one step's wall-clock time went on this rank, in seconds."""

    step: int
    """The step number given to ``begin_step``."""

    step_time: float
    """From begin_step to end_step."""

    compute_time: float
    """``step_time - comm_wait``: everything outside collectives, stretch included."""

    comm_wait: float
    """Time inside collectives (issuing, waiting for peers, transfer), network_delay
    included."""

    stretch_time: float
    """Sleep added to emulate a slow device (part of compute_time), as really slept."""

    network_delay: float
    """Sleep added to emulate slow links (part of comm_wait), as really slept: what remained
    of the modelled transfers when the rank blocked on them."""

    num_collectives: int = 0
    """Outermost collective calls in the step (nested calls are not counted)."""

    bytes_by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COMM_KINDS, 0))
    """Kind (``COMM_KINDS``) -> bytes of the tensors this rank handed to that kind's calls to
    send: an all-reduce's tensor, an all-to-all's input, a send's or isend's tensor, a gather's
    input off the root, a broadcast's or scatter's payload on the root; a recv and a barrier
    send none. Payload, not wire bytes (a ring all-reduce puts 2(n-1)/n of its tensor on the
    wire). Counted with emulation off too."""

    wait_by_kind: dict[str, float] = field(default_factory=zero_by_kind)
    """Kind -> seconds of ``comm_wait`` spent in that kind's calls and in ``wait()`` on their
    async works (the values sum to ``comm_wait``)."""
