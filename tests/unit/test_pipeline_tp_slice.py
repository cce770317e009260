"""``p2p.TPSlice``'s pieces (pure part; the gather runs in tests/distributed/test_kfkb_schedule.py,
whose PP=2 x TP=2 case must rebuild every message exactly for 1F1B's gradients bit for bit).

Oracle: the pieces of every TP rank, concatenated in rank order, are the flattened tensor, each
``numel / size`` elements and a view of it (no copy is sent); a size that does not divide the
element count sends the whole tensor from every rank.
"""

from __future__ import annotations

import torch

from colossal_hetero.pipeline.p2p import TPSlice


def _slices(size: int) -> list[TPSlice]:
    return [TPSlice(group=None, index=i, size=size) for i in range(size)]  # type: ignore[arg-type]


def test_pieces_cover_the_tensor_in_rank_order():
    for size in (2, 3, 4):
        x = torch.arange(2 * 12 * 5, dtype=torch.float32).reshape(2, 12, 5)
        pieces = [s.piece(x) for s in _slices(size)]
        assert all(p.numel() == x.numel() // size for p in pieces)
        assert all(p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for p in pieces)
        assert torch.equal(torch.cat(pieces), x.reshape(-1))


def test_indivisible_or_single_rank_sends_whole():
    x = torch.ones(7, 3)  # 21 elements
    for s in _slices(2) + _slices(4):
        assert not s.splits(x.numel()) and s.piece(x) is x
    assert not TPSlice(group=None, index=0, size=1).splits(8)  # type: ignore[arg-type]
    assert not _slices(2)[0].splits(0)


def test_uneven_units_cut_views_in_rank_order():
    # 3:13 of 1024 elements: 192 and 832, each a view; too few elements for the units: whole.
    x = torch.arange(1024, dtype=torch.float32).reshape(2, 16, 32)
    slices = [TPSlice(group=None, index=i, size=2, units=(3, 13)) for i in range(2)]  # type: ignore[arg-type]
    pieces = [s.piece(x) for s in slices]
    assert [p.numel() for p in pieces] == [192, 832]
    assert all(p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for p in pieces)
    assert torch.equal(torch.cat(pieces), x.reshape(-1))
    small = torch.ones(15)
    assert not slices[0].splits(small.numel()) and slices[1].piece(small) is small
