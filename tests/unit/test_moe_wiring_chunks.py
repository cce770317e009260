"""The plugin's automatic chunk size (``moe.chunk_auto``, moe/wiring.py's
``chosen_chunk_bytes``): hand-computed sizes for the bench model's dense gradient, and a brute
force over every chunk count of the cost rule of moe/chunks.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colossal_hetero.moe.chunks import chunking_cost
from colossal_hetero.moe.wiring import MIN_CHUNK_BYTES, MIN_CHUNKS, chosen_chunk_bytes

DENSE = 198272  # elements of bench moe's dense bf16 gradient (396544 B)


def _params(*sizes: int, dtype: torch.dtype = torch.bfloat16) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]


def test_dense_gradient_by_hand() -> None:
    # alpha 2 ms, beta 24 MB/s: N/beta = 16.52 ms; cost(k) = k*alpha + N/beta + alpha + N/(k beta)
    # k=1: 37.05 ms, 2: 30.78, 3: 30.03 (least), 4: 30.65; within 10% of 30.03 (33.03): k >= 2.
    params = _params(DENSE)
    assert chosen_chunk_bytes(params, (2e-3, 24e6), 512 * 1024) == 198272  # 2 chunks
    # Without expert replicas (EP=4): at least MIN_CHUNKS, so 4 of 49568 elements.
    assert MIN_CHUNKS == 4
    assert chosen_chunk_bytes(params, (2e-3, 24e6), 512 * 1024, MIN_CHUNKS) == 99136


def test_cap_below_the_floor_by_hand() -> None:
    # chunk_kib 8 (< MIN_CHUNK_BYTES): chunks of at most 8 KiB, the fewest: ceil(396544 / 8192)
    # = 49 chunks of ceil(198272 / 49) = 4047 elements.
    assert MIN_CHUNK_BYTES > 8192
    assert chosen_chunk_bytes(_params(DENSE), (2e-3, 24e6), 8192) == 8094


def test_no_parameters_keeps_the_cap() -> None:
    assert chosen_chunk_bytes([], (2e-3, 24e6), 262144) == 262144


@pytest.mark.parametrize("alpha", [1e-5, 3e-4, 2e-3, 2e-2])
@pytest.mark.parametrize("elements", [DENSE, 393216, 5000])
def test_matches_brute_force(alpha: float, elements: int) -> None:
    beta, most, slack = 24e6, 512 * 1024, 0.1
    total = 2 * elements
    counts = [
        k
        for k in range(1, elements + 1)
        if min(MIN_CHUNK_BYTES, total) <= 2 * -(-elements // k) <= most
    ]
    costs = {k: chunking_cost(total, k, alpha, beta, 1.0) for k in counts}
    least = min(costs.values())
    fewest = min(k for k, c in costs.items() if c <= (1 + slack) * least)
    size = chosen_chunk_bytes(_params(elements), (alpha, beta), most)
    assert size == 2 * -(-elements // fewest)
