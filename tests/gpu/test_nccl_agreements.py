"""Small host-built agreements on an NCCL group (skipped where torch sees no GPU).

One rank with NCCL (a single GPU): every check below passes host tensors to a collective on
an NCCL group, which NCCL alone refuses; the helpers (utils/collectives.py) move them to the
group's device and back. One rank makes every reduction the identity, so the expected values
are the inputs, computed on the host. Also the folded dispatch's header rows: built for rows
on the GPU from host counts, concatenated with them (a host header would not concatenate).

Run: ``python -m pytest tests/gpu -q`` on a machine with a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from colossal_hetero.moe.clip import ep_grad_norm
from colossal_hetero.moe.folded import _pack
from colossal_hetero.moe.profile import profile_groups
from colossal_hetero.utils import collectives
from colossal_hetero.utils import device as devices
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.skipif(
    devices.cuda_device_count() == 0, reason="needs a CUDA GPU (torch sees none)"
)


def _one_rank(rank: int, world_size: int, device: torch.device) -> None:
    assert dist.get_backend() == "nccl" and devices.collective_device() == device
    host = torch.tensor([1.5, -2.0, 3.0], dtype=torch.float64)
    collectives.all_reduce_anywhere(host, dist.ReduceOp.MAX)
    assert host.device.type == "cpu" and host.tolist() == [1.5, -2.0, 3.0]
    counts = torch.tensor([[3, 0, 7]], dtype=torch.int64)
    collectives.broadcast_anywhere(counts, 0)
    assert counts.device.type == "cpu" and counts.tolist() == [[3, 0, 7]]
    parts = collectives.all_gather_anywhere(host)
    assert len(parts) == 1 and parts[0].device.type == "cpu" and torch.equal(parts[0], host)
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]  # host gradients, no device given
    pairs = [(g.clone(), g) for g in grads]
    world = dist.group.WORLD
    assert world is not None
    norm = ep_grad_norm(pairs, set(), world, (True, True), 2.0)
    assert math.isclose(norm, 13.0, rel_tol=1e-12)
    alpha, beta = profile_groups([world], repeats=1)[0]
    assert alpha >= 0.0 and beta > 0.0


def test_host_agreements_on_nccl() -> None:
    run_distributed(_one_rank, 1)


def test_folded_header_rows_follow_the_payload_device() -> None:
    device = devices.local_device(0, 1)
    rows = torch.arange(6 * 16, dtype=torch.uint8).view(6, 16).to(device)
    counts = [torch.tensor([2, 1]), torch.tensor([3, 0])]  # host counts, as the block has them
    payload, send = _pack(rows, counts, [3, 2])
    assert payload.device == device and send == [3, 3]
    headers = [payload[0], payload[4]]  # header, 3 rows; header, 2 rows (cap)
    got = [h[:8].cpu().contiguous().view(torch.int32).tolist() for h in headers]
    assert got == [[2, 1], [3, 0]]
    assert torch.equal(payload[1:4], rows[0:3]) and torch.equal(payload[5:7], rows[3:5])
