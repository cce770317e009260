"""Pure math of 2D tensor parallelism (no process group): mesh layout and sizes, cost model."""

from __future__ import annotations

import pytest

from colossal_hetero.planner.tp2d_cost import (
    LayerDims,
    Shares2D,
    block_time,
    compare,
    cost_1d,
    cost_2d,
    place_2d,
)
from colossal_hetero.tp2d.layout import (
    MeshLayout,
    block_shape_2d,
    check_sizes,
    even_sizes,
    head_widths,
    mesh_side,
    offsets,
)


def test_mesh_side_accepts_squares_and_names_the_field():
    assert [mesh_side(n) for n in (1, 4, 9, 16)] == [1, 2, 3, 4]
    for bad in (0, 2, 3, 8, 12, -4):
        with pytest.raises(
            ValueError, match=r"^parallel\.tp: 2D tensor parallelism needs a square"
        ):
            mesh_side(bad)
    with pytest.raises(ValueError, match=r"^other\.field:"):
        mesh_side(6, field="other.field")


def test_layout_rows_and_columns_partition_the_ranks():
    # TP not innermost: a TP group of global ranks 1, 5, 9, 13 (stride 4), placed row-major.
    layout = MeshLayout.from_ranks([1, 5, 9, 13])
    assert layout.q == 2
    assert [layout.row_ranks(i) for i in range(2)] == [(1, 5), (9, 13)]
    assert [layout.col_ranks(j) for j in range(2)] == [(1, 9), (5, 13)]
    for rank in (1, 5, 9, 13):
        i, j = layout.position(rank)
        assert set(layout.row_ranks(i)) & set(layout.col_ranks(j)) == {rank}
        assert layout.global_rank(i, j) == rank
    nine = MeshLayout.from_ranks(range(9))
    rows = [r for i in range(3) for r in nine.row_ranks(i)]
    cols = [r for j in range(3) for r in nine.col_ranks(j)]
    assert sorted(rows) == sorted(cols) == list(range(9))
    # Colossal-AI legacy's default mapping t = i * q + j for a TP group 0..p-1.
    assert all(nine.position(t) == divmod(t, 3) for t in range(9))


def test_position_map_is_a_permutation():
    layout = MeshLayout.from_ranks([0, 1, 2, 3], position_map=[3, 1, 0, 2])
    assert layout.global_rank(0, 0) == 3 and layout.position(0) == (1, 0)
    with pytest.raises(ValueError, match="not a permutation"):
        MeshLayout.from_ranks([0, 1, 2, 3], position_map=[0, 1, 2, 2])
    with pytest.raises(ValueError, match="repeat"):
        MeshLayout((0, 0, 1, 2))
    with pytest.raises(IndexError):
        layout.global_rank(2, 0)


def test_sizes():
    assert even_sizes(10, 4) == (3, 3, 2, 2)
    assert even_sizes(0, 2) == (0, 0)
    assert offsets((3, 0, 2)) == (0, 3, 3)
    assert check_sizes([2, 3], 2, name="x", total=5) == (2, 3)
    with pytest.raises(ValueError, match="one size per mesh"):
        check_sizes([5], 2, name="x")
    with pytest.raises(ValueError, match="sum to 4, expected 5"):
        check_sizes([1, 3], 2, name="x", total=5)
    with pytest.raises(ValueError, match=">= 0"):
        check_sizes([-1, 3], 2, name="x")
    assert head_widths([3, 1], 16) == (48, 16)
    assert block_shape_2d((3, 1), (48, 16), 1, 0, middle=(7,)) == (1, 7, 48)


# ------------------------------------------------ cost model (planner/tp2d_cost.py)

SMALL = LayerDims(batch=2, seq=4, hidden=8, heads=4, ffn=32)  # bsh = 64, h^2 = 64, 2-byte


def test_cost_model_hand_computed_small_layer():
    costs = compare(SMALL, 4)
    one, sp, two = costs["1d"], costs["1d-sp"], costs["2d"]
    # Params: 1D 12h^2/P + sharded biases (3h + f)/P + replicated proj/fc2 biases 2h + LN 4h
    # = 192 + 14 + 16 + 32; 2D (0, 0): weights 4*12 + 4*4 + 4*16 + 16*4 = 192, vectors
    # 3*4 + 4 + 16 + 4 (biases) + 16 (two LNs' gain and shift of width 4) = 52.
    assert one.params == 254 and two.params == 244
    # Activations: unsplit sbh*34 + 5as^2b = 2176 + 640 = 2816; 1D sbh(10 + 24/4) + 640/4.
    assert one.activation_bytes == 1024 + 160
    assert sp.activation_bytes == 2816 / 4 == two.activation_bytes
    # 1D: four all-reduces of bsh = 64; ring bandwidth 8 bsh (P - 1) / P = 384.
    assert one.comm.calls == {("all_reduce", "tp"): [4, 256]}
    assert one.comm.bandwidth_words() == 384
    assert sp.comm.bandwidth_words() == 384  # SP: 4 all-gathers + 4 reduce-scatters, same words
    # 2D (m = 4 tokens, h_j = 4, f_j = 16, in sizes 8 or 32): per linear row broadcasts 2 m K,
    # column broadcasts 2 K n_j, row reduces m K, column reduces K n_j, 2q + q + q calls.
    assert two.comm.calls == {
        ("broadcast", "row"): [16, 2 * 4 * (8 + 8 + 8 + 32)],  # 448
        ("broadcast", "col"): [16, 2 * (8 * 12 + 8 * 4 + 8 * 16 + 32 * 4)],  # 768
        ("reduce", "row"): [8, 4 * (8 + 8 + 8 + 32)],  # 224
        ("reduce", "col"): [8, 8 * 12 + 8 * 4 + 8 * 16 + 32 * 4],  # 384
        ("all_reduce", "row"): [6, 2 * 4 * 4],  # two LNs: 2 of m = 4 forward, 1 of 2 m back
        ("all_reduce", "col"): [8, 12 + 4 + 16 + 4 + 2 * 2 * 4],  # biases, LN gains/shifts
    }
    # Optimus' 3 (7 bsh + 12 h^2) / q for the broadcasts and reduces, plus the small
    # all-reduces (84 words at 2 (q - 1) / q = 1).
    assert two.comm.bandwidth_words() == 3 * (7 * 64 + 12 * 64) / 2 + 84


def test_cost_model_trends_and_limits():
    dims = LayerDims(batch=16, seq=32, hidden=64, heads=16)
    words = []
    for q in (1, 2, 4):
        cost = cost_2d(dims, Shares2D.even(dims, q))
        big = sum(w for (op, _), (_, w) in cost.comm.calls.items() if op != "all_reduce")
        bsh, h2 = 16 * 32 * 64, 64 * 64
        assert big == (3 * (7 * bsh + 12 * h2) // q if q > 1 else 0)
        words.append(cost.comm.bandwidth_words())
        # Activations split by q^2 = P, against the unsplit layer.
        assert cost.activation_bytes * q * q == cost_1d(dims, 1).activation_bytes
    assert words[0] == 0 and words[1] > words[2]  # P = 1: no traffic; then falls with q
    assert cost_1d(dims, 1).comm.bandwidth_words() == 0
    one4 = cost_1d(dims, 4)
    # 1D keeps the 10 sbh term whole: sbh (10 + 24/P) - sbh 34 / P = 10 sbh (1 - 1/P).
    unsplit = cost_1d(dims, 1).activation_bytes
    assert one4.activation_bytes - unsplit / 4 == 10 * 16 * 32 * 64 * (1 - 1 / 4)
    # Small batch against a large hidden: 2D moves weights and loses on traffic.
    tiny = LayerDims(batch=2, seq=2, hidden=256, heads=4)
    assert (
        compare(tiny, 4)["2d"].comm.bandwidth_words()
        > compare(tiny, 4)["1d"].comm.bandwidth_words()
    )


def test_cost_model_uneven_and_errors():
    dims = LayerDims(batch=4, seq=5, hidden=16, heads=4, ffn=64)
    shares = Shares2D(batch_sizes=(3, 1), head_counts=(3, 1), ffn_sizes=(40, 24))
    # Rank (1, 1): the smallest block, m = 5 tokens, h_j = 4, f_j = 24.
    small, big = cost_2d(dims, shares, 1, 1), cost_2d(dims, shares, 0, 0)
    assert small.params == 4 * 4 * 3 + 4 * 4 + 4 * 24 + 24 * 4 + 9 * 4 + 24
    assert small.activation_bytes < big.activation_bytes
    with pytest.raises(ValueError, match="needs batch % q == 0"):
        Shares2D.even(LayerDims(batch=3, seq=1, hidden=8, heads=2), 2)
    with pytest.raises(ValueError, match=r"parallel\.tp: 2D tensor parallelism needs a square"):
        compare(dims, 8)
    with pytest.raises(ValueError, match="head_counts"):
        cost_2d(dims, Shares2D((2, 2), (3, 3), (32, 32)))
    with pytest.raises(ValueError, match="multiple of heads"):
        LayerDims(batch=1, seq=1, hidden=10, heads=4)


def test_resizable_placement_one_half_speed_device():
    speeds = [1.0, 1.0, 1.0, 0.5]
    even = block_time(speeds, (0, 1, 2, 3), (4, 4), (4, 4))
    assert even == 4 * 4 / 0.5  # the slow device's even block sets the pace: 32
    best = place_2d(speeds, batch=8, heads=8)
    # Slow device on its own row and column, that row (or column) shrunk to 3: blocks 5x4 = 20
    # at most on the fast ones and 3x4 / 0.5 = 24 on the slow one; no split does better (exhaustive:
    # 24 placements x 9 x 9 splits), so resizable 2D is 32 / 24 = 1.33x even 2D.
    assert best.slowest == 24
    assert block_time(speeds, best.positions, best.batch_sizes, best.head_counts) == 24
    i, j = divmod(best.positions.index(3), 2)
    assert best.batch_sizes[i] * best.head_counts[j] == 12  # the slow block: 12 / 0.5
    assert place_2d([1.0] * 4, batch=8, heads=8).slowest == 16  # equal devices: even is best
    with pytest.raises(ValueError, match="square"):
        place_2d([1.0] * 3, batch=4, heads=4)
    with pytest.raises(ValueError, match="> 0"):
        place_2d([1.0, 0.0, 1.0, 1.0], batch=4, heads=4)
    with pytest.raises(ValueError, match="exhaustive"):
        place_2d([1.0] * 9, batch=30, heads=30)
