"""Pure layout math of 2D tensor parallelism (no process group): mesh side, positions, sizes."""

from __future__ import annotations

import pytest

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
