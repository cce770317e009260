"""Short micro-benchmarks of this rank's device and links, and their agreement over the world.

Shared by ``colossal-hetero profile`` (bench/profile.py) and the plugin, which calibrates the
planner's device model at ``configure`` when the config gives no FLOP rate (``probe_world``).
Timings run under whatever collective interceptor is installed; emulation acts inside steps
only, so outside a step these measure the host as it is.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from colossal_hetero.utils.device import synchronize


def measure_flops(
    device: torch.device,
    size: int = 384,
    repeats: int = 7,
    dtype: torch.dtype = torch.float32,
    *,
    sync_each: bool = True,
) -> float:
    """Median FLOP/s of a ``size`` x ``size`` matmul on ``device``.

    With ``sync_each`` (and a process group), each timed matmul is followed by a barrier-free
    all_reduce of one number over the world group, so that compute emulation (which stretches
    the time between collectives) applies to it inside a step; the time then includes that
    all_reduce, so read the compute time from the interceptor. Without it only the matmul is
    timed.
    """
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    token = torch.zeros(1, device=device)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        (a @ b).sum()
        if sync_each and dist.is_initialized():
            dist.all_reduce(token)  # the boundary at which emulation stretches the matmul
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def measure_allreduce_gbps(device: torch.device, nbytes: int = 4 << 20, repeats: int = 5) -> float:
    """Bus bandwidth of a ring all_reduce of ``nbytes`` over the world group, Gbit/s (median)."""
    world = dist.get_world_size()
    if world == 1:
        return float("inf")
    tensor = torch.zeros(nbytes // 4, device=device)
    dist.all_reduce(tensor)  # warm the connections
    times = []
    for _ in range(repeats):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(tensor)
        synchronize(device)
        times.append(time.perf_counter() - start)
    bus_bytes = 2 * (world - 1) / world * nbytes
    return bus_bytes * 8 / statistics.median(times) / 1e9


def measure_latency_s(device: torch.device, repeats: int = 9) -> float:
    """Per-message latency: a one-number ring all_reduce's least time over its 2(m-1) hops."""
    world = dist.get_world_size()
    if world == 1:
        return 0.0
    token = torch.zeros(1, device=device)
    dist.all_reduce(token)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(token)
        synchronize(device)
        times.append(time.perf_counter() - start)
    # The least time: a loaded host only ever adds to a message's latency.
    return min(times) / (2 * (world - 1))


def measure_layer_overhead_s(device: torch.device, repeats: int = 15) -> float:
    """Fixed cost of one layer's step: forward and backward of an 8 x 8 linear (least time).

    At that size the work is nothing; what is left is the per-op framework and launch cost
    every layer pays whatever its shard, which the planner charges per layer.
    """
    weight = torch.randn(8, 8, device=device, requires_grad=True)
    x = torch.randn(1, 8, device=device)
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        (x @ weight).sum().backward()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times[1:])  # the first call builds autograd's state; load only adds time


def agree(value: float, device: torch.device, op: str = "min") -> float:
    """The same number on every rank (min or max over the world), so plans agree."""
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
    return float(tensor)


@dataclass(frozen=True, slots=True)
class WorldProbe:
    """Device and link figures agreed over the world (identical on every rank)."""

    flops: float
    """The fastest rank's matmul FLOP/s (the least contended measurement)."""
    layer_overhead_s: float
    """The least fixed per-layer cost any rank measured."""
    gbps: float
    """The slowest rank's all_reduce bus bandwidth, Gbit/s (inf on one rank)."""
    latency_s: float
    """The largest per-message latency any rank measured."""


def probe_world(device: torch.device) -> WorldProbe:
    """Measure on every rank and agree: one all_reduce (MAX) over the world group of
    ``[flops, -overhead, 1/gbps, latency]``. Call on every rank; takes well under a second
    (a 384^3 matmul 7 times, 1 MiB all_reduces 3 times, tiny ones 9 times)."""
    flops = measure_flops(device, sync_each=False)  # outside a step: nothing to stretch
    overhead = measure_layer_overhead_s(device)
    gbps = measure_allreduce_gbps(device, nbytes=1 << 20, repeats=3)
    latency = measure_latency_s(device)
    mine = torch.tensor([flops, -overhead, 1.0 / gbps, latency], dtype=torch.float64)
    mine = mine.to(device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    flops, neg_overhead, inv_gbps, latency = (float(v) for v in mine.cpu())
    return WorldProbe(
        flops=flops,
        layer_overhead_s=-neg_overhead,
        gbps=float("inf") if inv_gbps == 0 else 1.0 / inv_gbps,
        latency_s=latency,
    )
