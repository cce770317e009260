"""bench tp2d's pure parts: graph byte counting against hand counts, the batch search against a
linear scan, and the summary's ratios from a hand-made result."""

from __future__ import annotations

import random

import pytest
import torch

from colossal_hetero.bench.tp2d import Tp2dCase
from colossal_hetero.bench.tp2d_measure import forward_bytes, largest_fitting, state_bytes
from colossal_hetero.bench.tp2d_report import predicted_bytes, summary


class _Stash(torch.autograd.Function):
    """Keeps a tensor on ctx (as Colossal-AI's sequence-parallel linears do)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.kept = x * 2  # 4 x 8 floats the hooks never see
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad


def test_graph_bytes_hand_counted():
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)

    def forward() -> torch.Tensor:
        h = x @ w  # saves x (32 floats) and w (a parameter: excluded)
        t = torch.tanh(h)  # saves its result (32 floats)
        v = t.view(2, 16)
        u = v * v  # saves v twice: one storage, t's (counted once)
        s = _Stash.apply(u)  # ctx.kept: 32 floats found by the graph walk
        return s.sum()

    saved, loss = forward_bytes(forward, [w])
    assert saved == 4 * (32 + 32 + 32)
    loss.backward()  # the graph is intact
    assert state_bytes([w, w]) == 4 * 64 * 4  # one storage, four copies


def test_largest_fitting_matches_a_scan():
    rng = random.Random(1)
    for _ in range(200):
        limit = rng.randint(1, 300)
        threshold = rng.randint(0, limit + 5)
        calls: list[int] = []

        def fits(n: int, threshold: int = threshold, calls: list[int] = calls) -> bool:
            calls.append(n)
            return n <= threshold

        expected = min(threshold, limit)
        assert largest_fitting(fits, start=rng.randint(1, 20), limit=limit) == expected
        assert len(calls) <= 2 * limit.bit_length() + 2
    with pytest.raises(ValueError):
        largest_fitting(lambda n: True, start=1, limit=0)


def _median(value: float) -> dict[str, object]:
    return {"value": value, "ci": [value * 0.9, value * 1.1], "half_width": 0.1}


def test_summary_ratios_from_a_hand_made_result():
    case = Tp2dCase()
    model = predicted_bytes(case)
    measured = {"1d": 100.0, "1d_sp": 80.0, "2d": 60.0}
    memory = {
        name: {"activation_bytes": measured[name], "state_bytes": 1.0, "max_batch": batch}
        for name, batch in (("1d", 10), ("1d_sp", 12), ("2d", 25))
    }
    figures = {
        "resizable_vs_even_2d": _median(1.4),
        "step_1d_over_2d": _median(0.8),
        "step_1d_sp_over_2d": _median(0.7),
        "zero_resize_vs_even_2d": _median(1.2),
    }
    result = {
        "memory": memory,
        "rounds": {"figures": figures, "converged": False, "max_half_width": 0.1},
        "resized_plan": {"predicted_speedup": 1.5},
    }
    out = summary(case, result)
    assert out["activation_bytes_2d_over_1d"] == pytest.approx(0.6)
    assert out["activation_bytes_2d_over_1d_sp"] == pytest.approx(0.75)
    assert out["max_batch_2d_over_1d"] == pytest.approx(2.5)
    assert out["resizable_vs_even_2d"] == 1.4
    assert out["zero_resize_vs_even_2d"] == 1.2
    worst = max(abs(model[k] - measured[k]) / measured[k] for k in measured)
    assert out["cost_model_bytes_max_error"] == pytest.approx(worst)


def test_dedicated_device_stretch_targets_factor_times_cpu():
    from colossal_hetero.config.schema import EmulationConfig, SlowdownSpec
    from colossal_hetero.emulation import CollectiveInterceptor, SlowdownSchedule

    wall, cpu, slept = [0.0], [0.0], []

    class Fake(CollectiveInterceptor):
        def _work_clock(self) -> float:
            return cpu[0]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        wall[0] += seconds

    emulation = EmulationConfig(compute=[SlowdownSpec(rank=0, factor=4.0)])
    fake = Fake(
        0,
        1,
        slowdown=SlowdownSchedule.from_config(emulation, 0),
        sleep=sleep,
        clock=lambda: wall[0],
        stretch="dedicated",
    )
    fake._step = 0
    # 0.1 s of CPU took 0.3 s of wall (a contended host): the interval should last 0.4 s.
    cpu[0], wall[0] = 0.1, 0.3
    assert fake._arrive() == pytest.approx(0.4)
    assert slept == [pytest.approx(0.1)]
    # Contention beyond the factor: 0.1 s of CPU in 0.6 s of wall is not stretched further.
    fake._boundary, fake._work_boundary = 0.4, 0.1
    cpu[0], wall[0] = 0.2, 1.0
    assert fake._arrive() == pytest.approx(1.0)
    assert len(slept) == 1
