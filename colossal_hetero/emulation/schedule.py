"""Per-rank compute slowdown over steps. Pure: no torch.distributed, no clocks."""

from __future__ import annotations

from dataclasses import dataclass

from colossal_hetero.config.schema import EmulationConfig, SlowdownSpec


@dataclass(frozen=True, slots=True)
class SlowdownSchedule:
    """The compute slowdown factor of one rank at every step.

    A spec covers steps ``start_step <= step < end_step`` (``end_step`` None: forever). Where
    several specs of the rank overlap, the largest factor wins: each spec describes how slow
    the device is, not an extra slowdown on top of the others, so they do not compound.
    """

    rank: int
    """The global rank this schedule belongs to."""

    specs: tuple[SlowdownSpec, ...] = ()
    """The specs of this rank only, in config order."""

    @classmethod
    def from_config(cls, emulation: EmulationConfig, rank: int) -> SlowdownSchedule:
        """The schedule of ``rank``: the specs of ``emulation.compute`` that name it."""
        return cls(rank=rank, specs=tuple(s for s in emulation.slowdowns if s.rank == rank))

    @property
    def enabled(self) -> bool:
        """Whether any spec slows this rank at some step."""
        return any(s.factor > 1.0 for s in self.specs)

    def factor_at(self, step: int) -> float:
        """The factor (>= 1) by which this rank's compute is stretched at ``step``; 1.0 if none."""
        factor = 1.0
        for spec in self.specs:
            if spec.start_step <= step and (spec.end_step is None or step < spec.end_step):
                factor = max(factor, spec.factor)
        return factor
