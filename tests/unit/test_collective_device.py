"""collective_device (utils/device.py) and the agreement helpers' device handling
(utils/collectives.py), without a process group or a GPU.

- the device choice follows ``dist.get_backend(group)`` (mocked): NCCL -> the accelerator
  device from the device module's own helper (mocked), gloo and a mixed cpu/cuda group -> host;
- a tensor that lives elsewhere than the group's device reaches the collective as a copy on
  the group's device and the result lands back in the caller's tensor, on its own device; one
  already there is handed over itself (no copy). The "devices" are labels on a stand-in tensor
  (a CPU-only host has no second device to copy to), the collectives fakes that record the
  device they were given and compute a hand-known result.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from colossal_hetero.utils import collectives
from colossal_hetero.utils import device as devices

HOST = torch.device("cpu")
WIRE = torch.device("meta")  # a label standing for the accelerator: only compared, never used


@pytest.mark.parametrize(
    ("backend", "expected"),
    [("nccl", WIRE), ("NCCL", WIRE), ("gloo", HOST), ("cpu:gloo,cuda:nccl", HOST)],
)
def test_collective_device_follows_the_group_backend(monkeypatch, backend, expected) -> None:
    asked: list[Any] = []

    def get_backend(group: Any = None) -> str:
        asked.append(group)
        return backend

    monkeypatch.setattr(devices.dist, "get_backend", get_backend)
    monkeypatch.setattr(devices, "accelerator_device", lambda: WIRE)
    group = object()
    assert devices.collective_device(group) == expected
    assert devices.collective_device() == expected
    assert asked == [group, None]  # the group asked about is the one given (None: the world)


class Located:
    """A stand-in tensor: a list of numbers and a device label. ``to`` another device makes a
    copy, as torch does; torch's ``empty_like`` is routed here (``__torch_function__``)."""

    def __init__(self, values: list[float], device: torch.device) -> None:
        self.values, self.device = list(values), device

    def to(self, device: torch.device) -> Located:
        return self if device == self.device else Located(self.values, device)

    def contiguous(self) -> Located:
        return self

    def copy_(self, other: Located) -> None:
        self.values[:] = other.values

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.empty_like:
            return Located([0.0] * len(args[0].values), args[0].device)
        return NotImplemented


def _fake_dist(seen: list[Any]) -> SimpleNamespace:
    """Two ranks whose other rank holds the caller's values plus 10; records what it is given."""

    def all_reduce(tensor: Located, op: Any = None, group: Any = None) -> None:
        seen.append((tensor, tensor.device, op, group))
        tensor.values = [v + (v + 10) for v in tensor.values]

    def all_gather(parts: list[Located], tensor: Located, group: Any = None) -> None:
        seen.append((tensor, tensor.device, [p.device for p in parts], group))
        parts[0].values, parts[1].values = list(tensor.values), [v + 10 for v in tensor.values]

    def broadcast(tensor: Located, src: int, group: Any = None) -> None:
        seen.append((tensor, tensor.device, src, group))
        tensor.values = [v + 10 for v in tensor.values]  # the source's values

    return SimpleNamespace(
        all_reduce=all_reduce,
        all_gather=all_gather,
        broadcast=broadcast,
        get_world_size=lambda group=None: 2,
        ReduceOp=dist.ReduceOp,
    )


@pytest.fixture()
def seen(monkeypatch) -> list[Any]:
    calls: list[Any] = []
    monkeypatch.setattr(collectives, "dist", _fake_dist(calls))
    monkeypatch.setattr(collectives, "collective_device", lambda group=None: WIRE)
    return calls


def test_host_tensor_reaches_the_wire_and_the_result_comes_back(seen) -> None:
    group = object()
    host = Located([1.0, 2.0], HOST)
    collectives.all_reduce_anywhere(host, dist.ReduceOp.MAX, group)  # type: ignore[arg-type]
    (given, device, op, on), *_ = seen
    assert device == WIRE and given is not host and on is group and op == dist.ReduceOp.MAX
    assert host.device == HOST and host.values == [12.0, 14.0]  # in place, on the host

    bcast = Located([5.0], HOST)
    collectives.broadcast_anywhere(bcast, 3, group)  # type: ignore[arg-type]
    assert seen[1][1:] == (WIRE, 3, group) and bcast.values == [15.0] and bcast.device == HOST

    mine = Located([1.0, 2.0], HOST)
    parts = collectives.all_gather_anywhere(mine, group)  # type: ignore[arg-type]
    assert seen[2][1:] == (WIRE, [WIRE, WIRE], group)
    assert [p.values for p in parts] == [[1.0, 2.0], [11.0, 12.0]]
    assert all(p.device == HOST for p in parts) and mine.values == [1.0, 2.0]


def test_tensor_already_on_the_wire_is_used_itself(seen) -> None:
    there = Located([1.0], WIRE)
    collectives.all_reduce_anywhere(there)  # type: ignore[arg-type]
    collectives.broadcast_anywhere(there, 0)  # type: ignore[arg-type]
    parts = collectives.all_gather_anywhere(there)  # type: ignore[arg-type]
    assert [call[0] for call in seen] == [there, there, there]  # no copies
    assert there.values == [22.0] and [p.values for p in parts] == [[22.0], [32.0]]


def test_backend_questions_are_answered_by_the_device_module() -> None:
    from colossal_hetero.utils import device as dev

    # The configured kinds: only the GPU kind needs device tensors; auto is decided at run time.
    assert [dev.kind_needs_accelerator(k) for k in ("cpu", "auto", "cuda")] == [False] * 2 + [True]
    assert dev.is_host_backend("gloo") and dev.is_host_backend("GLOO")
    assert not dev.is_host_backend("nccl") and not dev.is_host_backend("cpu:gloo,cuda:nccl")
    # Colossal-AI's pipeline p2p stages tensors on the accelerator for NCCL and HCCL groups.
    staged = [dev.p2p_needs_device_tensors(n) for n in ("nccl", "hccl", "gloo")]
    assert staged == [True, True, False]


def test_current_device_is_colossalais_and_deepspeed_gets_the_matching_accelerator(monkeypatch):
    import colossalai.accelerator as accelerators

    fake = SimpleNamespace(get_current_device=lambda: WIRE)
    monkeypatch.setattr(accelerators, "get_accelerator", lambda: fake)
    assert devices.current_device() == WIRE  # whatever Colossal-AI's accelerator says
    assert devices.deepspeed_accelerator_name(HOST) == "cpu"
    assert devices.deepspeed_accelerator_name(torch.device("cuda", 0)) == "cuda"
