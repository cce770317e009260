"""pick_split on 2 gloo ranks with deterministic, rank-dependent fake step times.

Hand-computed oracle (seconds per step, rank 0 | rank 1 -> the slowest rank's):

- [3, 3]: 1.0 1.0 1.0 | 3.0 3.0 3.0 -> 3.0 3.0 3.0, median 3.0
- [4, 2]: 2.0 2.0 2.0 | 1.0 1.0 1.0 -> 2.0 2.0 2.0, median 2.0
- [2, 4]: 1.5 9.0 1.5 | 1.8 1.8 1.8 -> 1.8 9.0 1.8, median 1.8

The pick is [2, 4] on both ranks, though rank 0 alone would take [3, 3], rank 1 alone [4, 2],
and a mean over steps [4, 2] (2.0 < 4.2).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colossal_hetero.pipeline.split_trial import pick_split
from tests.dist_utils import run_distributed

CANDIDATES = [[3, 3], [4, 2], [2, 4]]
SECONDS = {
    0: [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [1.5, 9.0, 1.5]],
    1: [[3.0, 3.0, 3.0], [1.0, 1.0, 1.0], [1.8, 1.8, 1.8]],
}


def _run(rank, world_size, device):
    group = dist.new_group([0, 1])
    calls: list[tuple[int, int]] = []

    def step_seconds(index: int, step: int) -> float:
        calls.append((index, step))
        return SECONDS[rank][index][step]

    trial = pick_split(CANDIDATES, step_seconds, steps=3, group=group, device=torch.device("cpu"))
    assert trial.split == [2, 4] and trial.best == 2
    assert trial.steps_s == ((3.0, 3.0, 3.0), (2.0, 2.0, 2.0), (1.8, 9.0, 1.8))
    assert trial.medians_s == [3.0, 2.0, 1.8]
    # Rotating order: step i starts with candidate i.
    assert calls == [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1), (0, 1), (2, 2), (0, 2), (1, 2)]
    # Equal medians: the earlier candidate (the plugin's own split, listed first) wins.
    tie = pick_split(
        CANDIDATES, lambda index, step: 1.0 + rank, steps=2, device=torch.device("cpu")
    )
    assert tie.best == 0 and tie.medians_s == [2.0, 2.0, 2.0]
    # Separated after two steps (slowest rank: [1.0, 1.0] against [2.0, 2.0]): the third step
    # cannot change the pick, so it is not run, on either rank.
    calls.clear()
    early = pick_split(
        [[3, 3], [4, 2]],
        lambda index, step: calls.append((index, step)) or (index + 1.0) * (1 + rank) / 2,
        steps=3,
        device=torch.device("cpu"),
    )
    assert early.best == 0 and early.steps_s == ((1.0, 1.0), (2.0, 2.0))
    assert calls == [(0, 0), (1, 0), (1, 1), (0, 1)]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_pick_split_agrees_on_the_slowest_ranks_median():
    run_distributed(_run, world_size=2)
