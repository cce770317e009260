"""Chunks cut at gradient phases (moe/chunks.py ``phases``): hand-computed layouts and a
randomised check of every invariant against a per-element brute force."""

from __future__ import annotations

import random

import torch

from colossal_hetero.moe.chunks import SMALL_PHASE, Segment, plan_chunks

F32, BF16 = torch.float32, torch.bfloat16


def _layout(chunks) -> list[list[tuple[int, int, int]]]:  # type: ignore[no-untyped-def]
    return [[(s.param, s.start, s.stop) for s in c.segments] for c in chunks]


def test_phase_breaks_by_hand():
    # 10-element (40-byte) float32 chunks; walk 3, 2, 1, 0 (the default, last first).
    # Phases 0 | 1 1 | 2: runs [3] (12), [2, 1] (1 + 12), [0] (12), each in ceil(n / 10) even
    # pieces: 6 + 6 | 7 + 6 | 6 + 6.
    chunks = plan_chunks([12, 12, 1, 12], [F32] * 4, 40, phases=[2, 1, 1, 0])
    assert _layout(chunks) == [
        [(3, 0, 6)],
        [(3, 6, 12)],
        [(2, 0, 1), (1, 0, 6)],
        [(1, 6, 12)],
        [(0, 0, 6)],
        [(0, 6, 12)],
    ]
    # Parameter 2 alone in phase 1 (4 bytes < SMALL_PHASE * 40) joins phase 2's run:
    # [3] | [2, 1, 0] = 25 elements in 3 pieces of 9, 8, 8.
    assert 4 < SMALL_PHASE * 40
    chunks = plan_chunks([12, 12, 1, 12], [F32] * 4, 40, phases=[2, 2, 1, 0])
    assert _layout(chunks) == [
        [(3, 0, 6)],
        [(3, 6, 12)],
        [(2, 0, 1), (1, 0, 8)],
        [(1, 8, 12), (0, 0, 4)],
        [(0, 4, 12)],
    ]


def test_bench_expert_layout():
    # bench moe's expert gradient at EP=2 x DP=2: two layers of 3 x 32768-element bf16 tensors
    # per held expert, 2 experts each (196608 elements a layer), 262144-byte chunks. Without
    # phases the middle chunk spans both layers (it is ready only after the earlier layer's
    # backward); with the layer as phase each layer is two 98304-element chunks.
    numels, dtypes = [32768] * 12, [BF16] * 12
    layers = [0] * 6 + [1] * 6
    plain = plan_chunks(numels, dtypes, 262144)
    assert {i // 6 for i in plain[1].params} == {0, 1}
    phased = plan_chunks(numels, dtypes, 262144, phases=layers)
    assert [c.numel for c in phased] == [98304] * 4
    assert [{layers[i] for i in c.params} for c in phased] == [{1}, {1}, {0}, {0}]


def test_dtype_change_still_breaks():
    chunks = plan_chunks([4, 4], [F32, BF16], 1024, phases=[0, 0])
    assert [c.dtype for c in chunks] == [BF16, F32]
    assert [c.segments for c in chunks] == [(Segment(1, 0, 4),), (Segment(0, 0, 4),)]


def _runs_brute(numels, dtypes, chunk_bytes, walk, phases):  # type: ignore[no-untyped-def]
    """Runs by the rule, restated per parameter: start a new run at a dtype change, or at a
    phase change when the run so far holds at least SMALL_PHASE * chunk_bytes bytes."""
    runs: list[list[int]] = []
    for param in walk:
        if runs:
            run = runs[-1]
            nbytes = sum(numels[i] for i in run) * dtypes[run[-1]].itemsize
            same_dtype = dtypes[param] == dtypes[run[-1]]
            small = nbytes < SMALL_PHASE * chunk_bytes
            if same_dtype and (phases[param] == phases[run[-1]] or small):
                run.append(param)
                continue
        runs.append([param])
    return runs


def test_random_layouts_match_the_rule():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 9)
        numels = [rng.choice([0, 1, 3, 8, 17, 64]) for _ in range(n)]
        dtypes = [rng.choice([F32, F32, BF16]) for _ in range(n)]
        phases = [rng.randint(0, 3) for _ in range(n)]
        walk = list(range(n))
        rng.shuffle(walk)
        chunk_bytes = rng.choice([4, 8, 24, 64, 200])
        chunks = plan_chunks(numels, dtypes, chunk_bytes, walk, phases)
        # every element once, in walk order
        flat = [(s.param, e) for c in chunks for s in c.segments for e in range(s.start, s.stop)]
        assert flat == [(p, e) for p in walk for e in range(numels[p])]
        at = 0
        for run in _runs_brute(numels, dtypes, chunk_bytes, walk, phases):
            total = sum(numels[i] for i in run)
            if total == 0:
                continue
            capacity = chunk_bytes // dtypes[run[0]].itemsize
            count = -(-total // capacity)
            mine = chunks[at : at + count]
            at += count
            sizes = [c.numel for c in mine]
            assert sum(sizes) == total and max(sizes) - min(sizes) <= 1  # fewest, even
            assert max(sizes) <= capacity
            assert all(c.dtype == dtypes[run[0]] for c in mine)
            assert {p for c in mine for p in c.params} <= set(run)
        assert at == len(chunks) and [c.index for c in chunks] == list(range(len(chunks)))
