"""A stable chunk size from the alpha-beta profile (moe/chunks.py's ``choose_chunk_bytes``,
moe/profile.py's robust fit): hand-computed profiles -> chosen size, a brute-force oracle, and
noisy synthetic timings -> the same size as the noiseless profile."""

from __future__ import annotations

import random

import pytest

from colossal_hetero.moe.chunks import choose_chunk_bytes, chunking_cost
from colossal_hetero.moe.profile import (
    SIZES,
    SMALL_REPEATS,
    agree_times,
    fit_alpha_beta,
    lower_quartile,
)

ALPHA, BETA, TOTAL = 2e-3, 25e6, 400_000  # 2 ms, 25 MB/s: the gradient alone is 16 ms


def test_chunking_cost_by_hand() -> None:
    # 3 chunks of 400000/3 B: 3 * 2 ms + 16 ms + one a2a waiting 2 ms + 16/3 ms
    assert chunking_cost(TOTAL, 3, ALPHA, BETA, 1.0) == pytest.approx(
        0.006 + 0.016 + 0.002 + 0.016 / 3
    )
    with pytest.raises(ValueError, match="count"):
        chunking_cost(TOTAL, 0, ALPHA, BETA, 1.0)


def test_choice_by_hand() -> None:
    # cost(k) = 2k + 16 + 2 + 16/k ms: k=1 36, k=2 30, k=3 29.33 (best), k=4 30, k=5 31.2
    assert choose_chunk_bytes(TOTAL, ALPHA, BETA, slack=0.0) == 133_334  # k=3, ceil(400000/3)
    assert choose_chunk_bytes(TOTAL, ALPHA, BETA, slack=0.1) == 200_000  # bound 32.27: k=2
    assert choose_chunk_bytes(TOTAL, ALPHA, BETA, slack=0.25) == 400_000  # bound 36.67: k=1
    # bf16: 200000 elements in 3 -> 66667 elements of 2 bytes
    assert choose_chunk_bytes(TOTAL, ALPHA, BETA, itemsize=2, slack=0.0) == 133_334
    assert choose_chunk_bytes(TOTAL, ALPHA, BETA, itemsize=4, slack=0.0) == 133_336
    # no a2a waits behind a chunk: one chunk costs least
    assert choose_chunk_bytes(TOTAL, ALPHA, BETA, waits=0.0, slack=0.0) == TOTAL
    # bounds: at most 150000 B -> at least 3 chunks; at least 250000 B -> one chunk
    assert choose_chunk_bytes(TOTAL, ALPHA, BETA, slack=0.1, max_bytes=150_000) == 133_334
    assert choose_chunk_bytes(TOTAL, ALPHA, BETA, slack=0.0, min_bytes=250_000) == TOTAL
    # no latency: the most chunks the floor allows (40 of 10000 B), any slack reaches fewer
    assert choose_chunk_bytes(TOTAL, 0.0, BETA, slack=0.0, min_bytes=10_000) == 10_000


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"total_bytes": 0}, "total_bytes"),
        ({"alpha_s": -1.0}, "alpha"),
        ({"beta_bytes_per_s": 0.0}, "beta"),
        ({"min_bytes": 100, "max_bytes": 50}, "max_bytes"),
    ],
)
def test_choice_rejects_bad_input(kwargs: dict, message: str) -> None:
    args = {"total_bytes": TOTAL, "alpha_s": ALPHA, "beta_bytes_per_s": BETA} | kwargs
    with pytest.raises(ValueError, match=message):
        choose_chunk_bytes(**args)


def test_choice_against_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(300):
        total = rng.randint(1, 3_000_000)
        alpha, beta = rng.choice([0.0, rng.uniform(1e-5, 2e-2)]), rng.uniform(1e6, 1e9)
        waits, slack = rng.choice([0.0, 1.0, 2.5]), rng.choice([0.0, 0.05, 0.1, 0.4])
        low = rng.randint(1, max(1, total // 3))
        high = rng.choice([None, rng.randint(low, max(low, total))])
        most = total if high is None else high
        fewest = -(-total // most)
        counts = range(fewest, max(fewest, total // low) + 1)
        costs = {k: chunking_cost(total, k, alpha, beta, waits) for k in counts}
        best = min(costs.values())
        count = min(k for k, c in costs.items() if c <= (1 + slack) * best)
        got = choose_chunk_bytes(
            total, alpha, beta, waits=waits, slack=slack, min_bytes=low, max_bytes=high
        )
        assert got == -(-total // count), (total, alpha, beta, waits, slack, low, high)


def test_robust_statistics_by_hand() -> None:
    assert lower_quartile([9.0, 1.0, 5.0, 3.0, 7.0, 2.0, 8.0]) == 2.0  # index (7 - 1) // 4 = 1
    assert lower_quartile([4.0, 1.0, 3.0]) == 1.0
    assert agree_times([[1.0, 10.0], [3.0, 30.0], [2.0, 99.0]]) == [2.0, 30.0]
    assert agree_times([[1.0], [4.0]]) == [2.5]
    with pytest.raises(ValueError, match="every rank"):
        agree_times([[1.0], [1.0, 2.0]])
    with pytest.raises(ValueError, match="no samples"):
        lower_quartile([])


def test_three_point_fit_by_hand() -> None:
    # 16 KiB in 3 ms, 256 KiB in 12 ms, 1 MiB in 45 ms: beta = 786432 B / 33 ms
    alpha, beta = fit_alpha_beta((16384, 262144, 1048576), (0.003, 0.012, 0.045))
    assert beta == pytest.approx(786432 / 0.033)
    assert alpha == pytest.approx(0.003 - 16384 / beta)
    with pytest.raises(ValueError, match="increasing"):
        fit_alpha_beta((10, 20, 20), (1.0, 2.0, 3.0))


def _noisy_timings(rng: random.Random, alpha: float, beta: float) -> list[list[float]]:
    """One rank's samples per probe size, as profile.py takes them: the true time with 3%
    jitter, and each sample held up by load (1.5-5x longer) with probability 0.3."""
    rows = []
    for index, size in enumerate(SIZES):
        count = 7 * (SMALL_REPEATS if index == 0 else 1)
        true = alpha + size / beta
        row = [true * rng.uniform(0.97, 1.03) for _ in range(count)]
        rows.append([t * rng.uniform(1.5, 5.0) if rng.random() < 0.3 else t for t in row])
    return rows


@pytest.mark.parametrize(("alpha", "beta"), [(2e-3, 24e6), (5e-3, 24e6), (0.5e-3, 110e6)])
def test_noisy_samples_give_the_noiseless_size(alpha: float, beta: float) -> None:
    """The bench's dense bf16 gradient (396544 B) on 4 ranks: 40 draws of load noise through
    the profile's statistics (lower quartile per rank, median over ranks, fit) choose the
    chunk size of the noiseless profile every time."""
    total, bounds = 396544, {"itemsize": 2, "min_bytes": 16384, "max_bytes": 524288}
    expected = choose_chunk_bytes(total, alpha, beta, **bounds)
    rng = random.Random(11)
    for _ in range(40):
        ranks = [
            [lower_quartile(row) for row in _noisy_timings(rng, alpha, beta)] for _ in range(4)
        ]
        fitted = fit_alpha_beta(SIZES, agree_times(ranks))
        assert choose_chunk_bytes(total, *fitted, **bounds) == expected, fitted
