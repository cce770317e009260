"""Ada's decisions on a recorded trace stay what they were before its cost was cut.

The trace: seeded steps of a simulated pipeline (random compute, links a tenant loads every
other three steps), each measured as its ranks would record it (``_records_from_simulation``)
and run with the ``k`` chosen from the steps before, as the plugin's tuner does (window 4,
``min_gain`` 0.03, sticky). The expected ``k`` and predicted window times were recorded with
the code at 2b1b096, before the profile and the decision were made cheaper; a second
reference is the same decisions without the simulation cache. Session 11 fitted the times per
message into a download to the time they took there (``links._port_scale``): the trace's
links are separate per direction, so at step 5 of PP=4 a middle stage's download took both
kinds 0.7 ms per message faster than one shared port could, and the window sums of steps 5-8
moved by 0.24% (re-recorded); every ``k`` is unchanged.
"""

from __future__ import annotations

import random

import pytest

from colossal_hetero.pipeline.profile import profile_from_records
from colossal_hetero.pipeline.tuner import choose_k_over_window
from tests.unit.test_pipeline_profile import _records_from_simulation

# (k, predicted step seconds summed over the window) per step, recorded at 2b1b096
# (PP=4's steps 5-8 re-recorded in session 11: see the module doc).
RECORDED = {
    (4, 16): [
        (2, 0.544977709724), (2, 1.000170844057), (3, 1.59000430554), (3, 2.301276838523),
        (3, 2.576439611781), (2, 3.211499145047), (2, 3.23153402508), (2, 3.030180844454),
        (2, 2.834053302013), (3, 2.454111592911), (3, 2.846551025974), (3, 2.919678193463),
    ],
    (2, 8): [
        (2, 0.200993503801), (3, 0.432015366859), (3, 0.661070537536), (3, 1.012340370205),
        (3, 1.263607664824), (3, 1.440433877254), (3, 1.449884557903), (3, 1.299807539304),
        (3, 1.107665007369), (3, 1.107255376596), (3, 1.182097764663), (3, 1.444055550074),
    ],
}  # fmt: skip


def _replay(p: int, m: int, steps: int, seed: int, cached: bool) -> list[tuple[int, float]]:
    rng = random.Random(seed)
    k, window, out = 1, [], []
    cache: dict | None = {} if cached else None
    for step in range(steps):
        f = [rng.uniform(0.006, 0.012) for _ in range(p)]
        b = [2 * x for x in f]
        c = [rng.uniform(0.001, 0.004) for _ in range(p - 1)]
        if (step // 3) % 2 == 1:  # a tenant on one link
            c[rng.randrange(p - 1)] = rng.uniform(0.02, 0.04)
        records, _ = _records_from_simulation(f, b, c, m, k, rng.uniform(0.002, 0.01))
        window = (window + [profile_from_records(records, p, [1200.0] * p)])[-4:]
        decision = choose_k_over_window(window, m, min_gain=0.03, cache=cache, current_k=k)
        k = decision.k
        out.append((k, decision.predicted_step_s))
    return out


@pytest.mark.parametrize("p,m", sorted(RECORDED))
def test_decisions_on_a_recorded_trace_are_unchanged(p, m):
    got = _replay(p, m, 12, seed=7, cached=True)
    assert [k for k, _ in got] == [k for k, _ in RECORDED[(p, m)]]
    # Recorded to 12 decimals: the same arithmetic gives the same sums to rounding.
    for (_, t), (_, want) in zip(got, RECORDED[(p, m)], strict=True):
        assert t == pytest.approx(want, abs=1e-12)
    assert got == _replay(p, m, 12, seed=7, cached=False)  # the cache changes nothing
