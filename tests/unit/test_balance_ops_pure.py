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
    column_norm,
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


def test_resized_linear_flops_scale_with_kept_columns():  # O-A7, by accounting, not timing
    from torch.utils.flop_counter import FlopCounterMode

    from colossal_hetero.balance.ops import resized_linear

    x = torch.randn(6, 5, 16, requires_grad=True)
    weight = torch.randn(12, 16, requires_grad=True)
    bias = torch.randn(12, requires_grad=True)

    def flops(fn):
        with FlopCounterMode(display=False) as counter:
            fn().sum().backward()
        return counter.get_total_flops()

    stock = flops(lambda: torch.nn.functional.linear(x, weight, bias))
    for count in (4, 8, 12):
        kept = torch.arange(0, 16, 16 // count)[:count]
        # forward and both backward GEMMs: 3 x 2 x (6*5) x 12 x |P|
        assert (
            flops(lambda kept=kept: resized_linear(x, weight, bias, kept))
            == 3 * 2 * 30 * 12 * count
        )
    assert stock == 3 * 2 * 30 * 12 * 16


def test_resized_linear_against_hand_reference():  # O-A3, O-A4 in one process
    from colossal_hetero.balance.ops import resized_linear

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    kept, dropped = torch.tensor([0, 3, 4, 6]), torch.tensor([1, 2, 5])
    for impute in (0.0, 1e-18):
        for t in (x, weight, bias):
            t.grad = None
        y = resized_linear(x, weight, bias, kept, impute)
        (y * dy).sum().backward()
        # hand reference: the sum over the kept columns, term by term, in float64
        ref = sum(x[..., j, None] * weight[:, j] for j in kept.tolist()) + bias
        # 4 products plus bias, summed in another order: 5 terms of size < 5 * 5, 2 (k-1) u
        atol = 2 * 4 * torch.finfo(torch.float64).eps / 2 * 5 * 25
        torch.testing.assert_close(y, ref.detach(), rtol=0.0, atol=atol)
        y_full = torch.nn.functional.linear(x, weight, bias)
        dropped_part = x[..., dropped] @ weight[:, dropped].t()
        torch.testing.assert_close(y_full - y, dropped_part, rtol=0.0, atol=2 * atol)  # O-A3
        dy2, x2 = dy.reshape(-1, 5), x.detach().reshape(-1, 7)
        # kept entries: the same GEMMs on the same operands (O-A4 says exactly; allow 1 order)
        torch.testing.assert_close(
            x.grad[..., kept], dy @ weight.detach()[:, kept], rtol=0, atol=atol
        )
        torch.testing.assert_close(weight.grad[:, kept], dy2.t() @ x2[:, kept], rtol=0, atol=atol)
        assert bool((x.grad[..., dropped] == impute).all())
        assert bool((weight.grad[:, dropped] == impute).all())
        assert torch.equal(bias.grad, dy2.sum(0))


def test_frozen_columns_sgd_and_adamw():  # O-A5 on a plain parameter
    from colossal_hetero.balance.ops import frozen_columns

    cols = torch.tensor([1, 3])
    for make in (
        lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.1),
        lambda p: torch.optim.AdamW([p], lr=0.1, weight_decay=0.1),
        lambda p: torch.optim.Adam([p], lr=0.1, weight_decay=0.1, amsgrad=True),
    ):
        param = torch.nn.Parameter(torch.randn(3, 5, generator=torch.Generator().manual_seed(0)))
        optimizer = make(param)
        for step in range(3):
            param.grad = torch.randn(3, 5, generator=torch.Generator().manual_seed(step + 1))
            if step == 0:  # build momentum on every column first
                optimizer.step()
                continue
            before = param.detach().clone()
            state = {
                k: v.clone() for k, v in optimizer.state[param].items() if v.shape == param.shape
            }
            with frozen_columns(optimizer, [(param, 1, cols)]):
                optimizer.step()
            assert torch.equal(param.detach()[:, cols], before[:, cols])
            assert not torch.equal(param.detach(), before)  # the other columns moved
            for key, value in state.items():
                assert torch.equal(optimizer.state[param][key][:, cols], value[:, cols]), key
        # a state created by the frozen step itself starts at zero on the frozen columns
        fresh = torch.nn.Parameter(torch.randn(3, 5))
        optimizer = make(fresh)
        fresh.grad = torch.ones(3, 5)
        with frozen_columns(optimizer, [(fresh, 0, torch.tensor([2]))]):
            optimizer.step()
        for value in optimizer.state[fresh].values():
            if value.shape == fresh.shape:
                assert not value[2].any()


def test_mean_imputed_linear_against_autograd_reference():
    """Mean imputation: y = x_P W_P^T + mean_t(x_D) W_D^T + b, with exactly the gradients
    autograd gives that formula written out (float64); fp32 and bf16 against float64 within
    a bound derived from the sums; and its forward error below zero imputation's when the
    dropped features have a nonzero mean (as after LayerNorm or GELU)."""
    from colossal_hetero.balance.ops import complement, mean_imputed_linear, resized_linear
    from tests.tolerances import chain_atol

    gen = torch.Generator().manual_seed(11)
    shift = torch.randn(9, generator=gen, dtype=torch.float64)  # per-feature means
    x0 = torch.randn(3, 4, 9, generator=gen, dtype=torch.float64) + 2 * shift
    w0 = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    b0 = torch.randn(6, generator=gen, dtype=torch.float64)
    dy = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64)
    kept = torch.tensor([0, 2, 3, 7])
    dropped = complement(kept, 9)

    def grads(fn, dtype):
        x, w, b = (t.detach().to(dtype).requires_grad_() for t in (x0, w0, b0))
        y = fn(x, w, b)
        (y * dy.to(dtype)).sum().backward()
        return [t.double() for t in (y.detach(), x.grad, w.grad, b.grad)]

    def reference(x, w, b):
        mean = x[..., dropped].reshape(-1, dropped.numel()).mean(0)
        imputed = x.clone()
        imputed[..., dropped] = mean.expand(3, 4, -1)  # the same mean at every token
        return torch.nn.functional.linear(imputed, w, b)

    ref = grads(reference, torch.float64)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        got = grads(lambda x, w, b: mean_imputed_linear(x, w, b, kept, dropped), dtype)
        for name, g, r in zip(("y", "dx", "dw", "db"), got, ref, strict=True):
            # y, dx, dw, db: a sum of <= 12 products (tokens or features), the mean another
            # 12-term sum, inputs rounded once to dtype: 3 chained reductions of 12 terms
            scale = float(r.abs().max()) + float(x0.abs().max() * w0.abs().max() * 12)
            atol = chain_atol(3, 12, dtype, scale)
            torch.testing.assert_close(g, r, rtol=0.0, atol=atol, msg=f"{dtype} {name}")
    # every token gets the same imputed input gradient on the dropped columns
    dx = ref[1][..., dropped]
    assert torch.allclose(dx, dx[:1, :1].expand_as(dx), rtol=0, atol=1e-12)
    # the forward error against the full product: smaller than zero imputation's
    full = torch.nn.functional.linear(x0, w0, b0)
    err_mean = (full - mean_imputed_linear(x0, w0, b0, kept, dropped)).norm()
    err_zero = (full - resized_linear(x0, w0, b0, kept)).norm()
    assert err_mean < 0.5 * err_zero, (err_mean, err_zero)


def test_tracker_rebases_after_a_width_move():
    # column-parallel after a move: rows moved, the same K input features -> scores kept
    tracker = PriorityTracker(torch.zeros(2, 4), dim=1)
    tracker.refresh(torch.tensor([[0.5, 0.0, 2.0, 1.0], [0.0] * 4]), torch.arange(4))
    assert tracker.scores.tolist() == [0.5, 0.0, 2.0, 1.0]
    moved = torch.full((3, 4), 7.0)  # three rows now: no change can be measured this period
    assert tracker.refresh(moved, torch.arange(4)).tolist() == [0.5, 0.0, 2.0, 1.0]
    bumped = moved.clone()
    bumped[1, 1] += 4.0  # the next period measures against the new snapshot
    assert tracker.refresh(bumped, torch.tensor([1])).tolist() == [0.5, 4.0, 2.0, 1.0]
    # row-parallel after a move: the rank's K changed -> other columns, scores start afresh
    assert tracker.refresh(torch.zeros(3, 6), torch.arange(6)).tolist() == [1.0] * 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 1])
def test_tracker_refresh_equals_column_change(dtype, dim):
    generator = torch.Generator().manual_seed(dim)
    old = torch.randn(24, 40, generator=generator).to(dtype)
    new = (old.float() + 0.01 * torch.randn(24, 40, generator=generator)).to(dtype)
    tracker = PriorityTracker(old, dim=dim)
    got = tracker.refresh(new, torch.arange(old.shape[dim]))
    reference = column_change(new, old, dim)  # float64 of the same stored values
    # each difference rounds once in the weight's dtype (exact in bf16 where the values are
    # within 2x of each other, Sterbenz), then <= 40 terms summed in fp32
    eps = torch.finfo(dtype).eps
    terms = old.shape[1 - dim]
    torch.testing.assert_close(got, reference, rtol=eps + terms * 2**-23, atol=0.0)
    assert torch.equal(tracker.snapshot, new)  # the next period starts from the new weight


def test_magnitude_tracker_scores_every_column_by_its_norm():
    # norms by hand: columns (3, 4) -> 5, (0, 0) -> 0, (1, 0) -> 1, (0, 2) -> 2
    weight = torch.tensor([[3.0, 0.0, 1.0, 0.0], [4.0, 0.0, 0.0, 2.0]])
    tracker = PriorityTracker(weight, dim=1, rule="magnitude")
    assert tracker.scores.tolist() == [5.0, 0.0, 1.0, 2.0]
    assert column_norm(weight.t(), dim=0).tolist() == [5.0, 0.0, 1.0, 2.0]  # Conv1D layout
    assert select_kept(tracker.scores, 0.5).tolist() == [0, 3]
    # columns 1 and 2 dropped for a period: their scores are fresh all the same (no stale
    # score, no snapshot), so a dropped column that grew wins its place back at once
    grown = torch.tensor([[3.0, 6.0, 1.0, 0.0], [0.0, 8.0, 0.0, 2.0]])
    scores = tracker.refresh(grown, computed=torch.tensor([0, 3]))
    assert scores.tolist() == [3.0, 10.0, 1.0, 2.0]
    assert select_kept(scores, 0.5).tolist() == [0, 1]
    # a width move needs no rebasing: the new shard's columns are scored as they are
    assert tracker.refresh(torch.ones(4, 3), torch.arange(3)).tolist() == [2.0] * 3
    with pytest.raises(ValueError, match="priority rule"):
        PriorityTracker(weight, dim=1, rule="gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_magnitude_tracker_against_float64_brute_force(dtype):
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(24, 40, generator=generator).to(dtype)
    for dim in (0, 1):
        got = PriorityTracker(weight, dim=dim, rule="magnitude").scores
        stored = weight.double()  # the same stored values, summed exactly enough in float64
        columns = stored.t() if dim == 1 else stored
        reference = [sum(v * v for v in col.tolist()) ** 0.5 for col in columns]
        # float64 sum of <= 40 squares of exactly representable values, then one sqrt
        torch.testing.assert_close(
            got, torch.tensor(reference, dtype=torch.float64), rtol=64 * 2**-52, atol=0.0
        )
