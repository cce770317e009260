"""bench dynamic, pure parts: the phase schedule, the emulation it becomes, the ideal bound,
per-phase figures, detection delays and the summary (hand-computed values, no timing)."""

from __future__ import annotations

import math

import pytest

from colossal_hetero.bench.dynamic_phases import (
    Phase,
    acted,
    detection_delay,
    ideal_step,
    max_abs_diff,
    middle_half,
    phase_figures,
    slowdown_specs,
    summarise,
    three_phases,
)
from colossal_hetero.config.schema import EmulationConfig, SlowdownSpec
from colossal_hetero.emulation.schedule import SlowdownSchedule


def test_three_phases_schedule_and_emulation_agree_at_every_step() -> None:
    phases = three_phases(5, warmup=2)
    assert [(p.start, p.end) for p in phases] == [(2, 7), (7, 12), (12, 17)]
    assert [p.factors for p in phases] == [(1, 1, 1, 2), (1, 4, 1, 2), (1, 1, 1, 2)]
    assert phases[1].speeds == (1.0, 0.25, 1.0, 0.5)
    assert [p.stragglers for p in phases] == [(3,), (1, 3), (3,)]
    specs = slowdown_specs(phases)
    assert specs == [
        {"rank": 1, "factor": 4.0, "start_step": 7, "end_step": 12},
        {"rank": 3, "factor": 2.0, "start_step": 0, "end_step": None},
    ]
    emulation = EmulationConfig(compute=[SlowdownSpec(**s) for s in specs])
    for rank in range(4):
        schedule = SlowdownSchedule.from_config(emulation, rank)
        for step in range(20):  # warm-up runs at phase 1's speeds; the last phase never ends
            phase = next((p for p in phases if p.start <= step < p.end), None)
            want = (phase or (phases[0] if step < 2 else phases[-1])).factors[rank]
            assert schedule.factor_at(step) == want, (rank, step)


def test_on_a_device_base_every_rank_is_slowed_base_times_its_factor() -> None:
    """The throughput run's emulation: every rank at base x factor at every step (1x ranks
    at the base), and the unperturbed variant at the base alone."""
    from colossal_hetero.bench.dynamic_run import emulation_of, unperturbed_of

    phases = tuple(three_phases(5, warmup=2))
    slowed, plain = emulation_of(phases, 2.5), unperturbed_of(phases, 2.5)
    for rank in range(4):
        schedule = SlowdownSchedule.from_config(slowed, rank)
        even = SlowdownSchedule.from_config(plain, rank)
        for step in range(20):
            phase = next((p for p in phases if p.start <= step < p.end), None)
            want = (phase or (phases[0] if step < 2 else phases[-1])).factors[rank]
            assert schedule.factor_at(step) == 2.5 * want, (rank, step)
            assert even.factor_at(step) == 2.5
    assert emulation_of(phases) == EmulationConfig(
        compute=[SlowdownSpec(**s) for s in slowdown_specs(phases)]
    )


def test_middle_half_and_bad_sizes() -> None:
    phases = middle_half(160, rank=2, factor=8.0)
    assert [(p.start, p.end) for p in phases] == [(0, 40), (40, 120), (120, 160)]
    assert phases[1].factors == (1.0, 1.0, 8.0, 1.0)
    assert slowdown_specs(phases) == [{"rank": 2, "factor": 8.0, "start_step": 40, "end_step": 120}]
    with pytest.raises(ValueError, match="steps_per_phase"):
        three_phases(1, warmup=0)
    with pytest.raises(ValueError, match="ranks"):
        three_phases(4, warmup=0, world=2)
    with pytest.raises(ValueError, match="total_steps"):
        middle_half(3, rank=0, factor=2.0)


def test_ideal_bound_by_hand() -> None:
    # 1.0 s step, 0.6 s of it compute; speeds sum to 2.75 over 4 ranks: 0.4 + 0.6 * 4 / 2.75
    assert ideal_step(1.0, 0.6, (1.0, 0.25, 1.0, 0.5)) == pytest.approx(0.4 + 2.4 / 2.75)
    assert ideal_step(1.0, 0.6, (1.0,) * 4) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="positive"):
        ideal_step(1.0, 0.6, (1.0, 0.0))


def _series(phase_len: int, values: dict[str, tuple[float, float]]) -> dict[str, list[float]]:
    """Constant per-round series over two phases: name -> (phase 1 value, phase 2 value)."""
    return {k: [a] * phase_len + [b] * phase_len for k, (a, b) in values.items()}


def test_phase_figures_are_the_hand_ratios() -> None:
    phases = [Phase("p1", 1, 5, (1.0, 2.0)), Phase("p2", 5, 9, (1.0, 4.0))]
    series = _series(
        4,
        {
            "unperturbed.step": (1.0, 1.0),
            "unperturbed.compute": (0.5, 0.5),
            "stock.step": (1.5, 2.5),
            "stock.compute": (0.9, 0.9),
            "semi.step": (1.2, 1.5),
            "semi.compute": (0.9, 0.9),
        },
    )
    got = phase_figures(series, phases[1], warmup=1, variants=["semi", "stock"])
    ideal = 0.5 + 0.5 * 2 / 1.25
    assert got["semi"]["ideal_step_time"]["value"] == pytest.approx(ideal)
    assert got["semi"]["step_time"]["value"] == pytest.approx(1.5)
    assert got["semi"]["efficiency"]["value"] == pytest.approx(ideal / 1.5)
    assert got["semi"]["speedup_vs_stock"]["value"] == pytest.approx(2.5 / 1.5)
    assert got["semi"]["slowdown_removed"]["value"] == pytest.approx((2.5 - 1.5) / 1.5)
    assert got["stock"]["slowdown_removed"]["value"] == pytest.approx(0.0)
    first = phase_figures(series, phases[0], warmup=1, variants=["semi"])
    assert first["semi"]["step_time"]["value"] == pytest.approx(1.2)


def _record(step: int, stragglers: list[int], action: str = "none") -> dict:
    return {"step": step, "inputs": {"stragglers": stragglers}, "decision": {"action": action}}


def test_detection_delay_counts_steps_from_the_change() -> None:
    first = Phase("p1", 2, 10, (1.0, 1.0, 1.0, 2.0))
    phase = Phase("p2", 10, 20, (1.0, 4.0, 1.0, 2.0))
    last = Phase("p3", 20, 30, (1.0, 1.0, 1.0, 2.0))
    records = [
        _record(7, [3]),
        _record(9, [1, 3]),  # before the change: not this phase's
        _record(11, [3]),
        {"step": 12, "inputs": {"decision_step": 9}, "decision": {"action": "measured"}},
        _record(13, [0, 1]),  # rank 1 (the changed one) flagged; rank 0's flag is noise
        _record(15, [1, 3], "resize"),
        _record(21, [1, 3]),
        _record(23, [0, 3]),  # rank 1 released
    ]
    assert detection_delay(records, phase, first) == 4  # the record after step 13: 10..13
    assert detection_delay(records, first, None, 0) == 8  # rank 3 flagged at step 7
    assert detection_delay(records, last, phase) == 4
    assert detection_delay(records[:3], phase, first) is None
    assert [acted(r) for r in records] == [False] * 5 + [True, False, False]


def test_summary_picks_worst_values_and_never_invents_missing_ones() -> None:
    fig = {"value": 0.9, "ci": [0.8, 1.0]}

    def semi(eff: float, removed: float, speedup: float) -> dict:
        return {
            "efficiency": {**fig, "value": eff},
            "slowdown_removed": {**fig, "value": removed},
            "speedup_vs_stock": {**fig, "value": speedup},
        }

    model = {
        "model": "gpt2",
        "spike_phase": "phase2",
        "phases": {
            "phase1": {"semi": semi(0.95, 0.8, 1.2)},
            "phase2": {"semi": semi(0.9, 0.7, 1.8)},
        },
        "loss_diff": {"replan": 2e-6, "semi": 1e-6},
        "val_increase": {"semi": 0.001},
        "delays": {"replan": {"phase1": 4, "phase2": 6}, "semi": {"phase1": 4, "phase2": 8}},
    }
    other = {**model, "model": "llama", "loss_diff": {"replan": 5e-6, "semi": 0.0}}
    accuracy = {"drop_points": {"semi": 0.25}}
    out = summarise([model, other], accuracy, {"migrate": "refused", "resize": "refused"})
    assert out["semi_min_efficiency"] == 0.9
    assert out["semi_min_slowdown_removed"] == 0.7
    assert out["semi_speedup_in_4x_phase"] == 1.8
    assert out["replan_max_loss_diff"] == 5e-6
    assert out["semi_digits_accuracy_drop"] == 0.25
    assert out["semi_text_val_loss_increase"] == 0.001
    assert out["max_detection_delay_steps"] == 8
    for key in ("migrate_max_loss_diff", "resize_digits_accuracy_drop"):
        assert out[key] is None and "refused" in out["reasons"][key]
    undetected = {**model, "delays": {"semi": {"phase1": 3, "phase3": None}}}
    out = summarise([undetected], None, {})
    assert out["max_detection_delay_steps"] is None
    assert "gpt2 semi phase3" in out["reasons"]["max_detection_delay_steps"]
    assert out["semi_digits_accuracy_drop"] is None


def test_max_abs_diff() -> None:
    assert max_abs_diff([1.0, 2.0], [1.5, 1.0]) == 1.0
    with pytest.raises(ValueError):
        max_abs_diff([1.0], [1.0, 2.0])
    assert math.isclose(max_abs_diff([0.1], [0.1]), 0.0)
