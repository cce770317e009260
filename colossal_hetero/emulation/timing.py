"""The timing of one step, as the interceptor measures it. Pure data."""

from __future__ import annotations

from dataclasses import dataclass


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
    """Time inside collectives (waiting for peers, transfer), network_delay included."""

    stretch_time: float
    """Sleep added to emulate a slow device (part of compute_time), as really slept."""

    network_delay: float
    """Sleep added to emulate slow links (part of comm_wait): at least the modelled time."""

    num_collectives: int = 0
    """Outermost collective calls in the step (nested calls are not counted)."""
