"""Fixed gradient chunks: hand-computed boundaries, coverage, dtype breaks, chunk size errors."""

from __future__ import annotations

import pytest
import torch

from colossal_hetero.moe.chunks import Segment, even_chunk_bytes, plan_chunks

F32 = torch.float32


def test_boundaries_by_hand():
    # Params of 3, 10, 2 float32 elements; 16-byte chunks hold 4 elements; last param first.
    chunks = plan_chunks([3, 10, 2], [F32] * 3, 16)
    assert [c.segments for c in chunks] == [
        (Segment(2, 0, 2), Segment(1, 0, 2)),
        (Segment(1, 2, 6),),
        (Segment(1, 6, 10),),
        (Segment(0, 0, 3),),
    ]
    assert [c.numel for c in chunks] == [4, 4, 4, 3]
    assert chunks[0].params == (2, 1)


def test_every_element_once_and_sizes_bounded():
    numels = [7, 1, 0, 33, 5, 12]
    for chunk_bytes in (4, 8, 20, 64, 1000):
        chunks = plan_chunks(numels, [F32] * len(numels), chunk_bytes)
        assert all(0 < c.numel <= chunk_bytes // 4 for c in chunks)
        covered = sorted(
            (s.param, i) for c in chunks for s in c.segments for i in range(s.start, s.stop)
        )
        assert covered == [(p, i) for p, n in enumerate(numels) for i in range(n)]
        assert [c.index for c in chunks] == list(range(len(chunks)))


def test_dtype_change_starts_a_new_chunk_and_output_is_deterministic():
    dtypes = [F32, torch.float16, torch.float16]
    chunks = plan_chunks([2, 2, 2], dtypes, 64)
    assert [(c.dtype, c.params) for c in chunks] == [(torch.float16, (2, 1)), (F32, (0,))]
    assert plan_chunks([2, 2, 2], dtypes, 64) == chunks


@pytest.mark.parametrize(
    ("chunk_bytes", "message"),
    [(0, "moe.chunk_bytes must be > 0, got 0"), (-8, "must be > 0"), (2, "smaller than one")],
)
def test_bad_chunk_size(chunk_bytes, message):
    with pytest.raises(ValueError, match=message):
        plan_chunks([4], [F32], chunk_bytes)


def test_even_chunks_by_hand():
    # The bench's bf16 gradients at a 379 KiB (388096 B) chunk size: the dense 396544 B were
    # [388096, 8448] and the experts' 786432 B [388096, 388096, 10240]; evened, one chunk and
    # two equal ones (each at least the size, so at least as efficient).
    bf16 = torch.bfloat16
    assert even_chunk_bytes(396544, 388096, 2) == 396544
    assert [c.numel * 2 for c in plan_chunks([198272], [bf16], 396544)] == [396544]
    size = even_chunk_bytes(786432, 388096, 2)
    assert [c.numel * 2 for c in plan_chunks([196608, 196608], [bf16] * 2, size)] == [393216] * 2
    assert even_chunk_bytes(100, 4096, 4) == 100  # smaller than the size: one chunk
    with pytest.raises(ValueError, match="moe.chunk_bytes"):
        even_chunk_bytes(100, 0, 4)


def test_even_chunks_against_brute_force():
    # The chunk count is floor(total / size) (at least 1); every chunk but the last holds the
    # returned size, which is the smallest per-chunk capacity giving at most that many chunks.
    for elements in range(1, 200):
        for size in (4, 12, 40, 400, 1000):
            got = even_chunk_bytes(4 * elements, size, 4)
            count = max(1, 4 * elements // size)
            chunks = plan_chunks([elements], [F32], got)
            assert len(chunks) <= count
            smallest = min(
                c for c in range(1, elements + 1) if -(-elements // c) <= count
            )  # brute force: the least capacity (elements) with at most `count` chunks
            assert got == 4 * smallest
            if 4 * elements >= size:
                assert all(4 * c.numel >= size for c in chunks[:-1]) and got < 2 * size + 4


def test_order_walks_the_given_permutation_by_hand():
    # Params of 3, 10, 2 float32 elements walked 1, 0, 2 in 16-byte (4-element) chunks.
    chunks = plan_chunks([3, 10, 2], [F32] * 3, 16, order=[1, 0, 2])
    assert [c.segments for c in chunks] == [
        (Segment(1, 0, 4),),
        (Segment(1, 4, 8),),
        (Segment(1, 8, 10), Segment(0, 0, 2)),
        (Segment(0, 2, 3), Segment(2, 0, 2)),
    ]
    assert chunks[2].params == (1, 0) and chunks[3].params == (0, 2)
    assert plan_chunks([3, 10, 2], [F32] * 3, 16, order=[2, 1, 0]) == plan_chunks(
        [3, 10, 2], [F32] * 3, 16
    )
    for bad in ([0, 1], [0, 1, 1], [0, 1, 3]):
        with pytest.raises(ValueError, match="permutation"):
            plan_chunks([3, 10, 2], [F32] * 3, 16, order=bad)


def test_min_count_cuts_a_small_gradient_finer_by_hand():
    # EP=4's dense bf16 gradient, 198272 elements (396544 B), at the profiled 280 KiB
    # (286720 B): one chunk; at least 4: ceil(198272 / 4) = 49568 elements = 99136 B each.
    bf16 = torch.bfloat16
    assert even_chunk_bytes(396544, 286720, 2) == 396544
    size = even_chunk_bytes(396544, 286720, 2, min_count=4)
    assert size == 99136
    assert [c.numel for c in plan_chunks([198272], [bf16], size)] == [49568] * 4
    # 10 elements of 4 bytes in at least 3: ceil(10 / 3) = 4 elements, chunks 4, 4, 2.
    assert even_chunk_bytes(40, 4096, 4, min_count=3) == 16
    # More chunks than elements is capped at one per element; a big gradient keeps its count.
    assert even_chunk_bytes(8, 4096, 4, min_count=5) == 4
    assert even_chunk_bytes(786432, 131072, 2, min_count=4) == 131072
    with pytest.raises(ValueError, match="min_count"):
        even_chunk_bytes(40, 16, 4, min_count=0)


def test_wiring_evens_dense_into_min_chunks_by_hand():
    # _evened (moe/wiring.py): the EP=4 dense bf16 gradient (198272 elements) at a profiled
    # 280 KiB is cut into MIN_CHUNKS = 4 chunks of 49568 elements; a 20480-element (40 KiB)
    # one only into 40960 // MIN_CHUNK_BYTES = 2 (each at least 16 KiB): 10240 elements.
    from torch import nn

    from colossal_hetero.moe.wiring import MIN_CHUNK_BYTES, MIN_CHUNKS, _evened

    assert (MIN_CHUNKS, MIN_CHUNK_BYTES) == (4, 16384)
    bf16 = torch.bfloat16
    dense = [nn.Parameter(torch.zeros(n, dtype=bf16)) for n in (32768, 132736, 32768)]
    assert _evened(dense, 286720) == 396544  # one chunk, as without a minimum
    assert _evened(dense, 286720, MIN_CHUNKS) == 99136
    small = [nn.Parameter(torch.zeros(20480, dtype=bf16))]
    assert _evened(small, 286720, MIN_CHUNKS) == 20480
