"""The pure parts of the split trial (pipeline/split_trial.py): order, candidates, errors."""

from __future__ import annotations

import pytest
import torch

from colossal_hetero.pipeline.split_trial import SplitTrial, pick_split, rotated
from colossal_hetero.planner.stages import StageTimes, split_candidates

CPU = torch.device("cpu")


def test_rotation_puts_every_candidate_first_once_per_cycle():
    assert rotated(3, 0) == [0, 1, 2]
    assert rotated(3, 1) == [1, 2, 0]
    assert rotated(3, 5) == [2, 0, 1]
    for count in (1, 2, 5):
        firsts = [rotated(count, step)[0] for step in range(count)]
        assert sorted(firsts) == list(range(count))


def test_candidates_lead_with_the_given_split_then_near_best_by_hand():
    # 6 blocks, stage 1 twice as slow per block: [4, 2] balances 40 / 40 ms; [3, 3] has a
    # 60 ms stage (50% behind), [5, 1] 50 ms (25% behind).
    times = StageTimes((0.01, 0.02), (0.0, 0.0))
    assert split_candidates(6, times, slack=0.3, limit=3) == [[4, 2], [5, 1]]
    assert split_candidates(6, times, [3, 3], slack=0.3, limit=3) == [[3, 3], [4, 2], [5, 1]]
    assert split_candidates(6, times, [4, 2], slack=0.6, limit=2) == [[4, 2], [5, 1]]


def test_one_candidate_runs_nothing_and_bad_input_is_refused():
    def never(index: int, step: int) -> float:
        raise AssertionError("no step should run")

    trial = pick_split([[2, 2]], never, steps=3, device=CPU)
    assert trial == SplitTrial(((2, 2),), ((),), 0) and trial.split == [2, 2]
    for bad in ([], [[2, 2], [3, 2]], [[2, 2], [1, 1, 2]], [[4, 0], [2, 2]]):
        with pytest.raises(ValueError, match="^pick_split: "):
            pick_split(bad, never, steps=3, device=CPU)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        pick_split([[2, 2], [3, 1]], never, steps=0, device=CPU)
