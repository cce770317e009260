"""SlowdownSchedule: which factor applies to a rank at a step. Pure, no processes."""

from __future__ import annotations

from colossal_hetero.config.schema import EmulationConfig, SlowdownSpec
from colossal_hetero.emulation import SlowdownSchedule


def _schedule(rank: int, *specs: SlowdownSpec) -> SlowdownSchedule:
    return SlowdownSchedule.from_config(EmulationConfig(compute=list(specs)), rank)


def test_no_spec_means_factor_one() -> None:
    schedule = _schedule(0)
    assert not schedule.enabled
    assert [schedule.factor_at(s) for s in (0, 1, 10**6)] == [1.0, 1.0, 1.0]


def test_range_is_start_inclusive_end_exclusive() -> None:
    schedule = _schedule(1, SlowdownSpec(rank=1, factor=3.0, start_step=5, end_step=10))
    assert schedule.enabled
    assert [schedule.factor_at(s) for s in (4, 5, 9, 10)] == [1.0, 3.0, 3.0, 1.0]


def test_open_end_lasts_forever() -> None:
    schedule = _schedule(0, SlowdownSpec(rank=0, factor=2.0, start_step=3))
    assert schedule.factor_at(2) == 1.0
    assert schedule.factor_at(3) == schedule.factor_at(10**9) == 2.0


def test_only_this_ranks_specs_apply() -> None:
    spec = SlowdownSpec(rank=1, factor=4.0)
    assert _schedule(0, spec).factor_at(0) == 1.0
    assert not _schedule(0, spec).enabled
    assert _schedule(1, spec).factor_at(0) == 4.0


def test_overlapping_specs_take_the_largest_factor() -> None:
    schedule = _schedule(
        2,
        SlowdownSpec(rank=2, factor=2.0, start_step=0, end_step=8),
        SlowdownSpec(rank=2, factor=3.0, start_step=4, end_step=6),
    )
    assert [schedule.factor_at(s) for s in (0, 4, 5, 6, 8)] == [2.0, 3.0, 3.0, 2.0, 1.0]


def test_factor_one_spec_is_not_enabled() -> None:
    schedule = _schedule(0, SlowdownSpec(rank=0, factor=1.0))
    assert not schedule.enabled
    assert schedule.factor_at(0) == 1.0  # the configured factor itself, no arithmetic
