"""Pure math of the balancing ops: fractions, priority selection (O-P1..P5), splits (O-M2).

Every expected value is hand-computed here or brute-forced independently (itertools).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from colossal_hetero.balance.ops import (
    PriorityTracker,
    column_change,
    kept_count,
    kept_fraction,
    migrated_fraction,
    select_kept,
    split_migration,
    update_scores,
)


def test_kept_fraction_from_slowdown():
    # all-GEMM layer: rho = 1 / s, clipped to [min_fraction, 1]
    assert kept_fraction(2.0, min_fraction=0.1) == 0.5
    assert kept_fraction(4.0, min_fraction=0.1) == 0.25
    assert kept_fraction(4.0, min_fraction=0.5) == 0.5  # the accuracy budget caps the cut
    assert kept_fraction(0.7) == 1.0  # a fast rank keeps everything
    # g = 0.5: s (0.5 rho + 0.5) = 1 at s = 1.25 -> rho = 0.6; check the balance equation itself
    rho = kept_fraction(1.25, min_fraction=0.1, gemm_share=0.5)
    assert math.isclose(1.25 * (0.5 * rho + 0.5), 1.0, rel_tol=1e-12)  # a few roundings
    # monotone: a slower straggler never keeps more
    values = [kept_fraction(s, min_fraction=0.05) for s in (1.0, 1.1, 1.5, 2, 3, 8, 20)]
    assert values == sorted(values, reverse=True)
    for bad in ({"slowdown": 0.0}, {"slowdown": float("nan")}):
        with pytest.raises(ValueError, match="slowdown"):
            kept_fraction(**bad)
    with pytest.raises(ValueError, match="min_fraction"):
        kept_fraction(2.0, min_fraction=0.0)
    with pytest.raises(ValueError, match="gemm_share"):
        kept_fraction(2.0, gemm_share=1.5)


def test_migrated_fraction_balances_straggler_and_helpers():
    for s, helpers in [(2.0, 1), (4.0, 3), (8.0, 7), (1.5, 2)]:
        f = migrated_fraction(s, helpers)
        # straggler time s (1 - f) equals a helper's 1 + f / H (float64, a few roundings)
        assert math.isclose(s * (1 - f), 1 + f / helpers, rel_tol=1e-12)
    assert migrated_fraction(1.0, 3) == 0.0
    assert math.isclose(migrated_fraction(8.0, 10**9), 7 / 8, rel_tol=1e-8)  # -> 1 - 1/s
    with pytest.raises(ValueError, match="num_helpers"):
        migrated_fraction(2.0, 0)


def test_kept_count_rounding():
    assert kept_count(10, 1.0) == 10
    assert kept_count(10, 0.9) == 9  # 1 - 0.9 = 0.0999..; still drops one column
    assert kept_count(5, 0.5) == 3  # K - floor(K / 2), the authors' 50% cut
    assert kept_count(10, 0.01) == 1  # at least one column
    assert kept_count(0, 0.5) == 0  # a zero-width rank
    with pytest.raises(ValueError, match="fraction"):
        kept_count(4, 0.0)


def _brute_top(scores, count):
    """Brute force: the subset of ``count`` columns with the largest score sum, then the
    lexicographically smallest index set among equal sums (= ties to the lower index)."""
    best = None
    for subset in itertools.combinations(range(len(scores)), count):
        key = (-sum(scores[i] for i in subset), subset)
        best = key if best is None or key < best else best
    return list(best[1])


def test_select_kept_is_topk_with_low_index_ties():  # O-P2, O-P3, O-P4, O-P5
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):
        k = int(torch.randint(1, 8, (1,), generator=generator))
        # small integers: many exact ties, so the tie rule matters
        scores = torch.randint(0, 3, (k,), generator=generator).double()
        for fraction in (0.2, 0.5, 0.75, 1.0):
            kept = select_kept(scores, fraction)
            assert kept.tolist() == _brute_top(scores.tolist(), kept_count(k, fraction))
            assert kept.tolist() == sorted(kept.tolist())
            assert int(scores.argmax()) in kept.tolist()  # O-P4 (argmax = first max)
            assert torch.equal(kept, select_kept(scores.clone(), fraction))  # O-P5
        assert torch.equal(select_kept(scores, 1.0), torch.arange(k))  # O-P3


def test_scores_update_only_on_computed_columns():  # O-P1
    w_old = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]])
    w_new = torch.tensor([[1.5, 2.0, 1.0, 4.0], [0.0, -1.0, 0.0, 0.0]])
    change = column_change(w_new, w_old, dim=1)
    assert change.tolist() == [0.5, 1.0, 2.0, 0.0]  # column L1 changes, by hand
    assert column_change(w_new.t(), w_old.t(), dim=0).tolist() == change.tolist()  # Conv1D
    scores = torch.tensor([7.0, 7.0, 7.0, 7.0], dtype=torch.float64)
    new = update_scores(scores, change, torch.tensor([0, 2]))
    assert new.tolist() == [0.5, 7.0, 2.0, 7.0]  # dropped 1 and 3 keep their stale 7
    assert scores.tolist() == [7.0] * 4  # input not modified


def test_dropped_column_comes_back():
    # columns 2, 3 dropped at first; the kept ones then change little, so the stale ones win
    weight = torch.zeros(2, 4)
    tracker = PriorityTracker(weight, dim=1)
    kept = select_kept(tracker.scores, 0.5)
    assert kept.tolist() == [0, 1]  # all ones: ties to the lower index
    weight = weight + torch.tensor([[0.1, 0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    scores = tracker.refresh(weight, kept)
    assert scores.tolist() == pytest.approx([0.1, 0.2, 1.0, 1.0], abs=1e-7)  # fp32 weights
    assert select_kept(scores, 0.5).tolist() == [2, 3]


def test_split_migration_partitions():  # O-M2
    scores = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0, 0.0, 6.0, 1.0])
    split = split_migration(scores, migrate_count=4, num_helpers=3, drop_count=1)
    # priority order: 6, 0, 2, 4, 3, 1, 7 (tie 1 vs 7 -> 1 first), 5
    assert split.compute.tolist() == [0, 2, 6]
    assert [m.tolist() for m in split.migrated] == [[3, 4], [1], [7]]  # sizes 2, 1, 1
    assert split.dropped.tolist() == [5]  # the lowest priority is dropped, not migrated
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        k = int(torch.randint(1, 12, (1,), generator=generator))
        scores = torch.rand(k, generator=generator)
        migrate = int(torch.randint(0, k + 1, (1,), generator=generator))
        drop = int(torch.randint(0, k - migrate + 1, (1,), generator=generator))
        helpers = int(torch.randint(1, 4, (1,), generator=generator))
        split = split_migration(scores, migrate, helpers, drop)
        parts = [split.compute, *split.migrated, split.dropped]
        assert sorted(torch.cat(parts).tolist()) == list(range(k))  # disjoint, covering
        sizes = [m.numel() for m in split.migrated]
        assert sum(sizes) == migrate and max(sizes) - min(sizes) <= 1
        if split.compute.numel() and split.dropped.numel():  # roles follow priority
            assert scores[split.compute].min() >= scores[split.dropped].max()
    with pytest.raises(ValueError, match="migrate_count"):
        split_migration(scores, k, 1, 1)
