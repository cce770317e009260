"""The agreement helpers (utils/collectives.py) over a real 2-rank gloo world.

On gloo the group's device is the host (collective_device), a host tensor is handed to the
collective itself (no copy: the existing gloo behaviour, bit for bit), and each helper's
result equals the plain collective's on a clone of the same tensor, on the world and on a
subgroup: SUM and MAX all-reduces of float64 and int64 values, an all-gather and a broadcast
from the second rank. Rank-dependent values make a wrong result visible.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from colossal_hetero.utils import collectives
from colossal_hetero.utils.device import collective_device
from tests.dist_utils import run_distributed


def _values(rank: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.tensor([0.1 * (rank + 1), -3.0 * rank, 7.0 + rank], dtype=dtype)
    return torch.tensor([rank + 1, -3 * rank, 7 << (rank * 40)], dtype=dtype)


def _check(group, rank: int) -> None:  # type: ignore[no-untyped-def]
    assert collective_device(group) == torch.device("cpu")
    for dtype in (torch.float64, torch.int64):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            mine, plain = _values(rank, dtype), _values(rank, dtype)
            collectives.all_reduce_anywhere(mine, op, group)
            dist.all_reduce(plain, op=op, group=group)
            assert torch.equal(mine, plain) and mine.dtype == dtype
        mine = _values(rank, dtype)
        parts = collectives.all_gather_anywhere(mine, group)
        assert [p.tolist() for p in parts] == [_values(r, dtype).tolist() for r in range(2)]
        mine = _values(rank, dtype)
        collectives.broadcast_anywhere(mine, 1, group)
        assert torch.equal(mine, _values(1, dtype))


def _run(rank: int, world_size: int, device: torch.device) -> None:
    handed: list[torch.Tensor] = []
    plain = dist.all_reduce

    def spy(tensor: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        handed.append(tensor)
        return plain(tensor, *args, **kwargs)

    host = torch.tensor([float(rank)])
    collectives.dist.all_reduce = spy  # type: ignore[attr-defined]
    try:
        collectives.all_reduce_anywhere(host)
    finally:
        collectives.dist.all_reduce = plain  # type: ignore[attr-defined]
    assert len(handed) == 1 and handed[0] is host and host.item() == 1.0  # no copy on gloo
    _check(None, rank)
    _check(dist.new_group([0, 1]), rank)


def test_helpers_equal_plain_collectives_on_gloo() -> None:
    run_distributed(_run, 2, force_cpu=True)
