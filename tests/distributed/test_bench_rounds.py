"""bench.rounds under a spawned world: every rank runs the same rounds, whatever its own data.

The variants return rank-dependent numbers on purpose (a constant series on rank 0, heavy
noise on rank 1), so each rank alone would stop at a different round; with
``rank0_decides`` both must stop where rank 0's numbers say, with the same collective
sequence (each round's variant also all-reduces, which would hang on a divergence).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from colossal_hetero.bench.rounds import RoundsPolicy, rank0_decides, run_rounds
from tests.dist_utils import run_distributed


def _variants(device: torch.device, world_size: int, noisy: bool, seed: int) -> dict:
    """Variants ``a`` and ``b``: constant 1.0, or lognormal noise far too wide for +-3%."""
    noise = np.random.default_rng(seed).lognormal(0.0, 0.3, 1000)

    def variant(offset: int):
        def run(index: int, *, warmup: bool) -> float:
            token = torch.ones(1, device=device)
            dist.all_reduce(token)  # a collective per step, as a training step has
            assert float(token) == world_size
            return float(noise[2 * index + offset]) if noisy else 1.0

        return run

    return {"a": variant(0), "b": variant(1)}


def _check_rounds_agree(rank: int, world_size: int, device: torch.device) -> None:
    figures = {"b_over_a": lambda v: v["b"] / v["a"]}
    policy = RoundsPolicy(warmup=1, min_rounds=6, max_rounds=40, budget_s=1e9)
    decide = rank0_decides(device)

    # Rank 0 constant: it converges at round 6; rank 1 alone would run all 40 rounds.
    variants = _variants(device, world_size, noisy=rank == 1, seed=rank)
    result = run_rounds(variants, figures, policy, decide=decide)
    assert result.rounds == 6, result.rounds
    assert result.stopped_by == ("converged" if rank == 0 else "budget")

    # Rank 0 noisy: it runs to max_rounds; rank 1 (constant) alone would stop at round 6.
    variants = _variants(device, world_size, noisy=rank == 0, seed=7)
    result = run_rounds(variants, figures, policy, decide=decide)
    assert result.rounds == 40, result.rounds


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_every_rank_runs_the_rounds_rank0_decides():
    run_distributed(_check_rounds_agree, 2, force_cpu=True)
