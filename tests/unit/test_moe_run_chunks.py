"""``choose_run_chunk_bytes`` (moe/chunks.py): the chunk size judged by the plan it makes over
the phase runs, against brute force over every size, and the case that motivated it.

Oracle: for every size from ``min_bytes`` to ``max_bytes`` in whole elements, plan the chunks
(``plan_chunks``) and price the plan by hand (each chunk one alpha, the bytes once at beta,
one a2a waiting for the largest chunk); the answer must be a size whose plan is within the
slack of the least price, with no such plan of fewer chunks.
"""

from __future__ import annotations

import pytest
import torch

from colossal_hetero.moe.chunks import choose_chunk_bytes, choose_run_chunk_bytes, plan_chunks

BF16 = torch.bfloat16


def _price(numels, phases, size, alpha, beta):  # type: ignore[no-untyped-def]
    order = list(range(len(numels)))
    chunks = plan_chunks(numels, [BF16] * len(numels), size, order, phases)
    sizes = [2 * c.numel for c in chunks]
    return len(sizes) * alpha + sum(sizes) / beta + alpha + max(sizes) / beta, len(sizes)


CASES = [
    # (numels, phases, alpha, beta, min_bytes, max_bytes)
    ([300, 40, 500, 500, 120], [0, 0, 1, 1, 2], 1e-3, 1e6, 64, 4096),
    ([1000, 10, 10, 700, 900, 50], [0, 1, 1, 2, 2, 3], 2e-4, 5e6, 32, 8192),
    ([64] * 12, [0] * 6 + [1] * 6, 5e-3, 1e6, 16, 2048),
    ([5000, 3000], [0, 1], 0.0, 1e7, 256, 16384),  # alpha 0: the most chunks that help
]


@pytest.mark.parametrize("numels, phases, alpha, beta, low, high", CASES)
def test_matches_brute_force(numels, phases, alpha, beta, low, high):  # type: ignore[no-untyped-def]
    got = choose_run_chunk_bytes(
        numels,
        [BF16] * len(numels),
        alpha,
        beta,
        order=list(range(len(numels))),
        phases=phases,
        min_bytes=low,
        max_bytes=high,
    )
    assert low <= got <= high and got % 2 == 0
    priced = {size: _price(numels, phases, size, alpha, beta) for size in range(low, high + 1, 2)}
    least = min(cost for cost, _ in priced.values())
    fits = [(count, size) for size, (cost, count) in priced.items() if cost <= 1.1 * least]
    fewest = min(count for count, _ in fits)
    cost, count = priced[got]
    assert cost <= 1.1 * least * (1 + 1e-12) and count == fewest


def test_bench_dense_gradient_two_chunks_not_three():
    """bench moe's dense gradient in backward order: the lm head and final norm, layer 1's
    attention, norms and router, layer 0's and the embedding, one phase each (the a2a's come
    between them). Priced whole, 2 chunks of ~198 KB win; cut at the phases, that size makes 3
    (the lm head's phase is more than a quarter of it, so it stays apart). Over the runs, the
    plan of 2 chunks (the lm head joined to layer 1) is chosen."""
    attention = [16384] * 4 + [128, 128, 512]
    numels = [32768, 128, *attention, *attention, 32768]
    phases = [0, 0] + [1] * 7 + [2] * 8
    dtypes = [BF16] * len(numels)
    order = list(range(len(numels)))
    alpha, beta = 2.4e-3, 23.4e6
    total = 2 * sum(numels)
    whole = choose_chunk_bytes(total, alpha, beta, itemsize=2, min_bytes=16384, max_bytes=524288)
    assert len(plan_chunks(numels, dtypes, whole, order, phases)) == 3
    size = choose_run_chunk_bytes(
        numels, dtypes, alpha, beta, order=order, phases=phases, min_bytes=16384, max_bytes=524288
    )
    assert [c.numel for c in plan_chunks(numels, dtypes, size, order, phases)] == [99200, 99072]


def test_bad_profile_or_bounds():
    with pytest.raises(ValueError, match="beta"):
        choose_run_chunk_bytes([4], [BF16], 1e-3, 0.0, min_bytes=2, max_bytes=8)
    with pytest.raises(ValueError, match="bounds"):
        choose_run_chunk_bytes([4], [BF16], 1e-3, 1e6, min_bytes=16, max_bytes=8)


def test_random_cases_match_brute_force():
    """Seeded random gradients (2-8 parameters, 1-4 phases, profiles from latency-bound to
    bandwidth-bound): the same oracle as above."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(25):
        count = int(torch.randint(2, 9, (1,), generator=gen))
        numels = torch.randint(1, 600, (count,), generator=gen).tolist()
        phases = sorted(torch.randint(0, 4, (count,), generator=gen).tolist())
        alpha = float(torch.rand(1, generator=gen)) * 2e-3
        test_matches_brute_force(numels, phases, alpha, 1e6, 16, 2 * sum(numels) + 64)
