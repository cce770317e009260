"""The a2a/expert pipelining decision (moe/pipeline_model.py) against hand-computed cases."""

from __future__ import annotations

import pytest

from colossal_hetero.moe.pipeline_model import (
    MIN_GAIN,
    PROPOSE_GAIN,
    ExchangeInputs,
    choose_ranges,
    exchange_time,
    pass_time,
    step_measurements,
)

MS = 1e-3


def test_one_range_is_dispatch_compute_combine() -> None:
    # a = 1 ms + 2e5 B / 1e8 B/s = 3 ms; 2a + c = 6 + 5 ms.
    assert pass_time(1, 1 * MS, 1e8, 2e5, 5 * MS) == pytest.approx(11 * MS)


def test_latency_bound_two_ranges_cost_two_extra_alphas() -> None:
    # a2 = 1 + 1 = 2 ms, c/2 = 0.5 ms <= a2: the wire runs 4 a2a's back to back: 8 ms,
    # against one range's 2 * 3 + 1 = 7 ms (4 alpha + 2 S/beta).
    assert pass_time(2, 1 * MS, 1e8, 2e5, 1 * MS) == pytest.approx(8 * MS)
    assert pass_time(1, 1 * MS, 1e8, 2e5, 1 * MS) == pytest.approx(7 * MS)


def test_compute_bound_ranges_hide_all_but_one_range_of_wire() -> None:
    # alpha 0, S/beta 1 ms, c 4 ms: n ranges take 2 (1/n) + 4 ms.
    for n, expected in ((1, 6.0), (2, 5.0), (4, 4.5)):
        assert pass_time(n, 0.0, 1e8, 1e5, 4 * MS) == pytest.approx(expected * MS)


def test_latency_bound_block_stays_unpipelined() -> None:
    # Measured-like inputs: alpha 1 ms, 512 rows of 256 B at 1e8 B/s (1.31072 ms), expert
    # compute 1 ms forward, 2 ms backward. n=1: (2 * 2.31072 + 1) + (2 * 2.31072 + 2) =
    # 12.24288 ms; n=2: a2 = 1.65536 ms, both passes latency bound: 8 * a2 = 13.24288 ms.
    inputs = ExchangeInputs(
        alpha=1 * MS, beta=1e8, rows=512, row_bytes=256, fwd_row_s=MS / 512, bwd_row_s=2 * MS / 512
    )
    assert exchange_time(1, inputs) == pytest.approx(12.24288 * MS)
    assert exchange_time(2, inputs) == pytest.approx(13.24288 * MS)
    ranges, record = choose_ranges(inputs, 4)
    assert ranges == 1
    assert record["ranges"] == 1 and set(record["predicted_s"]) == {1, 2, 3, 4}
    assert record["inputs"]["rows"] == 512


def test_compute_bound_block_pipelines_as_far_as_allowed() -> None:
    # alpha 0, S/beta 1 ms, compute 4 ms forward, 8 ms backward: n=1 16 ms, n=2 14 ms,
    # n=4 (0.5 + 4) + (0.5 + 8) = 13 ms.
    inputs = ExchangeInputs(
        alpha=0.0, beta=1e8, rows=1000, row_bytes=100, fwd_row_s=4e-6, bwd_row_s=8e-6
    )
    assert [exchange_time(n, inputs) / MS for n in (1, 2, 4)] == pytest.approx([16, 14, 13])
    assert choose_ranges(inputs, 4)[0] == 4
    assert choose_ranges(inputs, 2)[0] == 2
    assert choose_ranges(inputs, 1)[0] == 1
    # The chooser's proposal margin: n=4 is 18.75% ahead (13 against 16 ms), under 20%.
    assert choose_ranges(inputs, 4, margin=PROPOSE_GAIN)[0] == 1
    assert choose_ranges(inputs, 4, margin=0.15)[0] == 4


def test_folded_counts_charge_pipelining_the_counts_a2a() -> None:
    # alpha 1.2 ms, S/beta 1 ms, compute 4 ms forward, 8 ms backward. n=1: a = 2.2, passes
    # 4.4 + 4 and 4.4 + 8: 20.8 ms. n=2: a = 1.7, c = 2 and 4 per range: forward 7.4 ms
    # (wire 3.4, range 0 computed 3.7, combine to 5.4, range 1 computed 5.7, combine to 7.4),
    # backward 11.4 ms: 18.8 ms, 9.6% ahead. With the counts folded at one range, n=2 pays
    # one more alpha: 20.0 ms, 3.8% ahead, under MIN_GAIN: one range.
    kwargs = {"alpha": 1.2 * MS, "beta": 1e8, "rows": 1000, "row_bytes": 100}
    compute = {"fwd_row_s": 4e-6, "bwd_row_s": 8e-6}
    apart = ExchangeInputs(**kwargs, **compute)
    folded = ExchangeInputs(**kwargs, **compute, counts_folded=True)
    assert exchange_time(1, apart) == pytest.approx(20.8 * MS)
    assert exchange_time(2, apart) == pytest.approx(18.8 * MS)
    assert exchange_time(1, folded) == pytest.approx(20.8 * MS)
    assert exchange_time(2, folded) == pytest.approx(20.0 * MS)
    assert choose_ranges(apart, 2)[0] == 2 and choose_ranges(folded, 2)[0] == 1
    assert choose_ranges(folded, 2)[1]["inputs"]["counts_folded"] is True


def test_gain_below_margin_keeps_one_range() -> None:
    # alpha 0, S/beta 1 ms, compute 0.2 ms forward and backward: n=1 2 * 2.2 = 4.4 ms; n=2
    # latency... a2 = 0.5 >= c/2 = 0.1: 4 * 0.5 = 2 ms per pass, 4 ms: gain 9% > MIN_GAIN.
    inputs = ExchangeInputs(
        alpha=0.0, beta=1e8, rows=1000, row_bytes=100, fwd_row_s=2e-7, bwd_row_s=2e-7
    )
    assert choose_ranges(inputs, 2)[0] == 2
    # alpha 0.05 ms: n=1 2 * (2 * 1.05 + 0.2) = 4.6 ms, n=2 2 * 4 * 0.55 = 4.4 ms: 4.3% gain.
    slow = ExchangeInputs(
        alpha=0.05 * MS, beta=1e8, rows=1000, row_bytes=100, fwd_row_s=2e-7, bwd_row_s=2e-7
    )
    assert 1 - exchange_time(2, slow) / exchange_time(1, slow) < MIN_GAIN
    assert choose_ranges(slow, 2)[0] == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"alpha": -1.0},
        {"beta": 0.0},
        {"rows": -1},
        {"fwd_row_s": -1.0},
    ],
)
def test_bad_inputs_raise(kwargs: dict) -> None:
    base = {
        "alpha": 0.0,
        "beta": 1.0,
        "rows": 1,
        "row_bytes": 1,
        "fwd_row_s": 0.0,
        "bwd_row_s": 0.0,
    }
    with pytest.raises(ValueError, match="pipeline model"):
        ExchangeInputs(**{**base, **kwargs})


def test_bad_counts_raise() -> None:
    with pytest.raises(ValueError, match="n must be >= 1"):
        pass_time(0, 0.0, 1.0, 1.0, 1.0)
    inputs = ExchangeInputs(alpha=0, beta=1, rows=1, row_bytes=1, fwd_row_s=0, bwd_row_s=0)
    with pytest.raises(ValueError, match="most must be >= 1"):
        choose_ranges(inputs, 0)


def _step_log(a2a: list[tuple[float, float, int]]) -> list[tuple]:
    rows: list[tuple] = [("pending", "ep", 99, 0.0, 50.0, 0), ("chunk", "dense", 0, 40.0, 45.0, 8)]
    rows += [("a2a", "ep", i, t0, t1, n) for i, (t0, t1, n) in enumerate(a2a)]
    return sorted(rows, key=lambda row: row[3])


def test_step_measurements_by_hand() -> None:
    # Two layers (ms): forward triples (counts, dispatch, combine), backward pairs.
    log = _step_log(
        [
            (0.0, 1.0, 32),  # counts, 1 ms
            (1.0, 3.0, 1000),  # dispatch 2 ms; experts 3 -> 4
            (4.0, 6.0, 1000),  # combine 2 ms
            (7.0, 10.0, 32),  # counts, 3 ms
            (10.0, 12.0, 1000),  # experts 12 -> 15
            (15.0, 17.0, 1000),
            (20.0, 22.0, 1000),  # backward layer 1: experts 22 -> 24
            (24.0, 26.0, 1000),
            (30.0, 32.0, 1000),  # backward layer 0: experts 32 -> 36
            (36.0, 38.0, 1000),
        ]
    )
    got = step_measurements([(k, g, i, a * MS, b * MS, n) for k, g, i, a, b, n in log], 2)
    assert got is not None
    alpha, per_byte, fwd, bwd = got
    assert alpha == pytest.approx(2 * MS)  # median of 1 and 3 ms
    # 8 data calls of 2 ms = 16 ms, less 8 alphas = 0 ms beyond latency: 0 s per byte
    assert per_byte == pytest.approx(0.0, abs=1e-15)
    assert fwd == pytest.approx(2 * MS)  # mean of 1 and 3 ms
    assert bwd == pytest.approx(3 * MS)  # mean of 2 and 4 ms


def test_step_measurements_per_byte_and_wrong_counts() -> None:
    # One layer: counts 1 ms; data calls 3 ms each for 1e5 bytes: 4 x (3 - 1) ms = 8 ms over
    # 4e5 bytes = 2e-8 s per byte.
    calls = [(0.0, 1.0, 32), (1.0, 4.0, 100000), (5.0, 8.0, 100000)]
    calls += [(10.0, 13.0, 100000), (14.0, 17.0, 100000)]
    log = [(k, g, i, a * MS, b * MS, n) for k, g, i, a, b, n in _step_log(calls)]
    alpha, per_byte, fwd, bwd = step_measurements(log, 1) or [0.0] * 4
    assert alpha == pytest.approx(MS) and per_byte == pytest.approx(2e-8)
    assert fwd == pytest.approx(MS) and bwd == pytest.approx(MS)
    assert step_measurements(log, 2) is None  # 5 calls, not 10: pipelined or partial step
    assert step_measurements([row for row in log if row[2] != 4], 1) is None  # one a2a short
