"""bench tp2d's measurement on 4 gloo ranks against the planner's op-level accounting.

One spawn, a 1-layer GPT-2 (h = 64, 4 heads, V = 256): for stock 1D, 1D + split_gather SP
and 2D, the activation bytes measured from the autograd graph equal
``gpt2_activation_bytes`` to within the scalars it leaves out (a few bytes per op: 1e-3
relative), on every rank; the largest batch under a budget found by the search equals the
largest batch whose bytes (measured once per batch size, linear in the batch) fit; and the
three variants compute the same first loss (same weights, same batch).
"""

from __future__ import annotations

import pytest
import torch

from colossal_hetero.planner.tp2d_memory import gpt2_activation_bytes
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow


def _check(rank: int, world_size: int, device: torch.device) -> None:
    from colossal_hetero.bench.tp2d import Tp2dCase, _memory, even_shares, measure_overhead
    from colossal_hetero.bench.tp2d_measure import sequence_parallel_on_gloo
    from colossal_hetero.bench.tp2d_runners import OneDRunner, TwoDRunner, text_batch
    from colossal_hetero.plugin import prepare_device

    prepare_device(device)
    case = Tp2dCase(layers=1, hidden=64, heads=4, seq_len=16, batch_size=4, budget_mib=1.0)
    model = case.model()
    with sequence_parallel_on_gloo():
        runners = {
            "1d": OneDRunner(model, device, sequence_parallel=False),
            "1d_sp": OneDRunner(model, device, sequence_parallel=True),
            "2d": TwoDRunner(model, device, even_shares(case, case.batch_size)),
        }
        batch = text_batch(case.batch_size, case.seq_len, 0, case.vocab)
        losses = {name: float(r.forward(batch)) for name, r in runners.items()}
        memory = _memory(case, runners, device)
        calibration = measure_overhead(case, runners, device, repeats=1)
    # The overhead every rank plans with is one agreed, finite, non-negative number.
    agreed = [None] * world_size
    torch.distributed.all_gather_object(agreed, calibration["overhead"])
    assert len(set(agreed)) == 1 and 0.0 <= agreed[0] < float("inf"), agreed
    for a in losses.values():
        assert a == pytest.approx(losses["2d"], rel=1e-5), losses
    for name, mode in (("1d", "1d"), ("1d_sp", "1d-sp"), ("2d", "2d")):
        kw = dict(layers=1, seq=16, hidden=64, heads=4, vocab=256, tp=4)
        predicted = gpt2_activation_bytes(mode, batch=case.batch_size, **kw)  # type: ignore[arg-type]
        measured = memory[name]["activation_bytes_per_rank"]
        assert all(m == pytest.approx(predicted, rel=1e-3) for m in measured), (name, measured)
        # Search against the linear model: state + bytes(b) <= budget, b even for 2D rows.
        state, budget = memory[name]["state_bytes"], case.budget_mib * 2**20
        fitting = [
            b
            for b in range(1, case.max_batch_limit + 1)
            if state + _bytes(mode, b, kw) * (1 + 1e-3) <= budget
        ]
        best = max(fitting, default=0)
        assert abs(memory[name]["max_batch"] - best) <= 1, (name, memory[name]["max_batch"], best)


def _bytes(mode: str, batch: int, kw: dict) -> float:
    if mode != "2d":
        return gpt2_activation_bytes(mode, batch=batch, **kw)  # type: ignore[arg-type]
    # 2D splits an odd batch (b + 1) / 2 and (b - 1) / 2: the larger row decides.
    rows = 2 * ((batch + 1) // 2)
    return gpt2_activation_bytes("2d", batch=rows, **kw)


def test_bench_tp2d_bytes_and_search_match_the_accounting():
    run_distributed(_check, 4)
