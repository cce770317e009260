"""The balancer's one collective: every rank's report row, all-gathered.

The group is the **world**: under data and pipeline parallelism every tensor-parallel group
runs the same widths (``plugin.resize`` is world-wide), so every rank needs every group's
measurements to take the same decision (balance/window.py combines them per position).
Without DP/PP the world is the tensor-parallel group. It is called every ``balancer.every``
steps by every rank, after the step's clock stopped, so its cost is not charged to a step;
the sequence of calls depends on the step number alone, never on local data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def all_gather_rows(
    row: Sequence[float], group: ProcessGroup | None, device: torch.device
) -> list[list[float]]:
    """Every rank's ``row`` (the same length on every rank), in group rank order.

    One ``all_gather`` of a float64 tensor of ``len(row)`` elements over ``group`` (None:
    the world); float64 carries the seconds and byte counts exactly enough for the decisions.
    """
    mine = torch.tensor(list(row), dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [part.cpu().tolist() for part in parts]
