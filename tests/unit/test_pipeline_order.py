"""kfkb_order against independent 1F1B/GPipe references and a lockstep message-passing executor."""

from __future__ import annotations

import math
from collections import deque

import pytest

from colossal_hetero.pipeline.order import (
    expected_peak_in_flight,
    kfkb_order,
    peak_in_flight,
)

MAX_P, MAX_M = 8, 32


def one_f_one_b_reference(p: int, s: int, m: int) -> list[tuple[str, int]]:
    """Colossal-AI 0.5.0 OneForwardOneBackwardSchedule.run_forward_backward, read off its loops:
    warm-up min(p - s - 1, m) forwards; then m - warm-up times (forward next, backward oldest);
    then warm-up backwards."""
    warmup = min(p - s - 1, m)
    out = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [("F", warmup + i), ("B", i)]
    out += [("B", m - warmup + i) for i in range(warmup)]
    return out


def lockstep_run(orders: list[list[tuple[str, int]]]) -> dict[tuple[int, str, int], int]:
    """Execute per-stage orders with non-blocking (buffered) sends and blocking FIFO receives.

    Each tick, every stage whose next step has its input waiting runs it. Returns the tick of
    every (stage, op, mb); raises AssertionError on deadlock or a message received out of order.
    """
    p = len(orders)
    fwd = [deque[int]() for _ in range(p)]  # fwd[s]: activations waiting at stage s
    bwd = [deque[int]() for _ in range(p)]  # bwd[s]: gradients waiting at stage s
    pos = [0] * p
    when: dict[tuple[int, str, int], int] = {}
    tick = 0
    while any(pos[s] < len(orders[s]) for s in range(p)):
        ready = []
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            op, mb = orders[s][pos[s]]
            inbox = fwd[s] if op == "F" else bwd[s]
            needs_msg = (op == "F" and s > 0) or (op == "B" and s < p - 1)
            if not needs_msg or inbox:
                ready.append(s)
        assert ready, f"deadlock at tick {tick}: positions {pos}"
        for s in ready:  # receive and compute this tick, deliver sends after the tick
            op, mb = orders[s][pos[s]]
            if op == "F" and s > 0:
                assert fwd[s].popleft() == mb, "activation received out of order"
            if op == "B" and s < p - 1:
                assert bwd[s].popleft() == mb, "gradient received out of order"
            when[(s, op, mb)] = tick
            pos[s] += 1
        for s in ready:
            op, mb = orders[s][pos[s] - 1]
            if op == "F" and s < p - 1:
                fwd[s + 1].append(mb)
            if op == "B" and s > 0:
                bwd[s - 1].append(mb)
        tick += 1
    return when


def all_cases():
    for p in range(1, MAX_P + 1):
        for m in range(1, MAX_M + 1):
            for k in range(1, m + 1):
                yield p, m, k


def test_k1_is_colossalai_1f1b():
    for p in range(1, MAX_P + 1):
        for m in range(1, MAX_M + 1):
            for s in range(p):
                assert kfkb_order(p, s, m, 1) == one_f_one_b_reference(p, s, m), (p, s, m)


def test_k_equal_m_is_gpipe():
    for p in range(1, MAX_P + 1):
        for m in range(1, MAX_M + 1):
            gpipe = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
            for s in range(p):
                assert kfkb_order(p, s, m, m) == gpipe


def test_hand_written_orders():
    # p=2, m=5, k=2: groups [0,1] [2,3] [4]; stage 0 warms up one group.
    assert kfkb_order(2, 0, 5, 2) == [
        ("F", 0), ("F", 1),
        ("F", 2), ("F", 3), ("B", 0), ("B", 1),
        ("F", 4), ("B", 2), ("B", 3),
        ("B", 4),
    ]  # fmt: skip
    assert kfkb_order(2, 1, 5, 2) == [
        ("F", 0), ("F", 1), ("B", 0), ("B", 1),
        ("F", 2), ("F", 3), ("B", 2), ("B", 3),
        ("F", 4), ("B", 4),
    ]  # fmt: skip


def test_each_microbatch_once_forward_then_backward_in_increasing_order():
    for p, m, k in all_cases():
        for s in range(p):
            order = kfkb_order(p, s, m, k)
            fwd = [mb for op, mb in order if op == "F"]
            bwd = [mb for op, mb in order if op == "B"]
            assert fwd == list(range(m)) and bwd == list(range(m)), (p, s, m, k)
            where = {step: i for i, step in enumerate(order)}
            assert all(where[("F", i)] < where[("B", i)] for i in range(m))


def test_peak_in_flight_formula():
    for p, m, k in all_cases():
        for s in range(p):
            peak = peak_in_flight(kfkb_order(p, s, m, k))
            assert peak == expected_peak_in_flight(p, s, m, k) == min(k * (p - s), m)
            if m % k == 0:  # the formula k * min(p - s, m / k)
                assert peak == k * min(p - s, m // k)
            else:  # never more than k * min(p - s, ceil(m / k)), and never above m
                assert peak <= k * min(p - s, math.ceil(m / k))


def test_no_deadlock_and_cross_stage_order():
    for p, m, k in all_cases():
        orders = [kfkb_order(p, s, m, k) for s in range(p)]
        when = lockstep_run(orders)
        assert len(when) == 2 * p * m
        for s in range(p):
            for i in range(m):
                if s > 0:
                    assert when[(s, "F", i)] > when[(s - 1, "F", i)]
                if s < p - 1:
                    assert when[(s, "B", i)] > when[(s + 1, "B", i)]


def test_executor_detects_deadlock():
    # Stage 0 waits for a gradient while stage 1 waits for the activation: must be refused.
    orders = [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]
    with pytest.raises(AssertionError, match="deadlock"):
        lockstep_run(orders)


@pytest.mark.parametrize(
    "args, field",
    [((2, 0, 4, 5), "k"), ((2, 0, 4, 0), "k"), ((2, 2, 4, 1), "stage"),
     ((0, 0, 4, 1), "num_stages"), ((2, 0, 0, 1), "num_microbatches")],
)  # fmt: skip
def test_bad_arguments(args, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        kfkb_order(*args)
