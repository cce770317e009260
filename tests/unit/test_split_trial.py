"""The pure parts of the split trial (pipeline/split_trial.py): order, candidates, errors."""

from __future__ import annotations

import pytest
import torch

from colossal_hetero.pipeline.split_trial import SplitTrial, decided, pick_split, rotated
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


def _full_pick(seen: list[list[float]], margin: float = 0.0) -> int:
    medians = [sorted(s)[len(s) // 2] for s in seen]  # odd counts: the middle one
    scores = [m * (1.0 - margin if i == 0 else 1.0) for i, m in enumerate(medians)]
    return min(range(len(seen)), key=lambda i: (scores[i], i))


def _check_decided_by_brute_force(grid: list[float], margin: float = 0.0) -> None:
    """Two candidates, two of three steps seen, every pair of values from ``grid``: an early
    decision is the full trial's pick for every completion, and none is made while two picks
    remain possible."""
    import itertools

    for first in itertools.product(grid, repeat=4):
        seen = [list(first[0:2]), list(first[2:4])]
        early = decided(seen, steps=3, margin=margin)
        picks = {
            _full_pick([[*seen[0], a], [*seen[1], b]], margin)
            for a in [0.0, *grid, 9.0]
            for b in [0.0, *grid, 9.0]
        }
        if early is not None:
            assert picks == {early}
        if len(picks) > 1:
            assert early is None


def test_decided_only_when_no_remaining_steps_can_change_the_pick():
    # PP=2 x TP=2's trial (session 9, idle): [4, 8] 1.706 1.662 vs [5, 7] 1.841 1.843. With
    # one step of 3 left, [4, 8]'s median is at most max(1.706, 1.662) and [5, 7]'s at least
    # min(1.841, 1.843): decided.
    assert decided([[1.706, 1.662], [1.841, 1.843]], steps=3) == 0
    # Overlapping steps: a third step decides (PP=4's trial).
    assert decided([[0.975, 1.069], [1.028, 1.260], [1.120, 1.048]], steps=3) is None
    # One step of three: never decided (a median needs two of the three).
    assert decided([[1.0], [5.0]], steps=3) is None
    # Ties go to the earlier candidate: equal bounds decide for it, not for a later one.
    assert decided([[1.0, 1.0], [1.0, 1.0]], steps=3) == 0  # at most 1.0 against at least 1.0
    assert decided([[1.0, 2.0], [1.0, 1.0]], steps=3) is None  # the later one only ties at best
    assert decided([[2.0, 2.0], [1.0, 1.0]], steps=3) == 1


def test_decided_agrees_with_every_completion_by_brute_force():
    # Every decision made early is the full trial's pick for every way the remaining steps
    # could go (values from a small grid, which holds ties and both orders).
    _check_decided_by_brute_force([1.0, 2.0, 3.0])


def test_margin_keeps_the_first_split_on_near_ties_and_decided_agrees(monkeypatch):
    from colossal_hetero.pipeline import split_trial

    # One rank: the slowest rank's seconds are this rank's (no process group needed).
    monkeypatch.setattr(split_trial.dist, "all_reduce", lambda *args, **kwargs: None)

    # The session 21 trial: [5, 7] (the plugin's) 2.406 2.471 2.618 against [4, 8] 2.459 2.457
    # 2.515. Medians 2.471 vs 2.457: [4, 8] 0.6% ahead. Without a margin it wins; with 3% the
    # plugin's split stays (2.471 * 0.97 = 2.397 < 2.457).
    steps = {0: [2.406, 2.471, 2.618], 1: [2.459, 2.457, 2.515]}

    def step_seconds(index: int, step: int) -> float:
        return steps[index][step]

    candidates = [[5, 7], [4, 8]]
    assert pick_split(candidates, step_seconds, 3, device=CPU).best == 1
    assert pick_split(candidates, step_seconds, 3, device=CPU, margin=0.03).best == 0
    # A clear win (10% faster) still displaces it.
    steps[1] = [x * 0.9 for x in steps[0]]
    assert pick_split(candidates, step_seconds, 3, device=CPU, margin=0.03).best == 1
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="margin must be in"):
            pick_split(candidates, step_seconds, 3, device=CPU, margin=bad)
    # Early decisions with a margin are the full trial's pick for every completion.
    _check_decided_by_brute_force([1.0, 1.04, 1.1], margin=0.05)
