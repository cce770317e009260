"""The communication patterns of ``bench network``, run on every rank of either network mode.

The same code runs on shaped links and on loopback under the interceptor's network model,
both started by ``bench.shaped_spawn`` (``run_shaped_ranks``, ``run_bench_ranks``): it builds
the interceptor with ``build_interceptor`` from the phase's config, so model mode uses whatever
model that gives, and shaped mode gets none. Every step first reports itself (the shaped
controller then applies that step's preemptions) and pauses ``settle_s`` so a rate change or
tenant burst is in place before the timed transfers.

Phases (``Phase.name``):
- ``alone`` (2 ranks): step 0 times all-reduce, p2p 0->1 and all_to_all_single, each alone, and
  a small all-to-all alone and issued while a large all-reduce runs on a second group.
- ``preempt`` (3 ranks): p2p 0->2 (the targeted rank) and 0->1 (untouched) at step 0 (no
  preemption), step 1 (rank 2's links at a lower rate) and step 2 (a tenant pushes into rank 2).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from colossal_hetero.bench.shaped_spawn import report_bench_step
from colossal_hetero.config.schema import EmulationConfig, NetworkEmulationConfig, PreemptionSpec
from colossal_hetero.emulation import build_interceptor

_MIB = 1 << 20
_ISSUE_LEAD_S = 0.02  # the large all-reduce is on the wire before the small all-to-all starts


@dataclass(frozen=True, slots=True)
class Phase:
    """One launch: its ranks, network and repeats; sizes are MiB of each rank's input."""

    name: str
    world: int
    rate_gbps: float
    repeats: int
    preemptions: list[dict[str, Any]] = field(default_factory=list)
    allreduce_mib: float = 4.0
    p2p_mib: float = 2.0
    alltoall_mib: float = 2.0
    small_alltoall_mib: float = 0.25
    background_mib: float = 8.0
    settle_s: float = 0.5

    def network(self, mode: Literal["model", "shaped"]) -> NetworkEmulationConfig:
        preemptions = [PreemptionSpec(**p) for p in self.preemptions]
        return NetworkEmulationConfig(
            mode=mode, bandwidth_gbps=self.rate_gbps, preemptions=preemptions
        )


def _floats(mib: float) -> torch.Tensor:
    return torch.ones(int(mib * _MIB) // 4)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _p2p(rank: int, src: int, dst: int, mib: float) -> float | None:
    """Send ``mib`` from src to dst; the receiver's time (its recv returns on arrival)."""
    buffer = _floats(mib)
    dist.barrier()
    if rank == src:
        dist.send(buffer, dst)
    elif rank == dst:
        return _timed(lambda: dist.recv(buffer, src))
    return None


def _alone_step(rank: int, phase: Phase, background: Any) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}

    def add(name: str, seconds: float | None, collective: bool = True) -> None:
        # A collective is timed on rank 0, a p2p on its receiver: one clock per pattern, so
        # a rank that waits for a late peer does not mix its wait into the transfer's median.
        if seconds is not None and (rank == 0 or not collective):
            times.setdefault(name, []).append(seconds)

    big, small = _floats(phase.allreduce_mib), _floats(phase.small_alltoall_mib)
    a2a_in, a2a_out = _floats(phase.alltoall_mib), _floats(phase.alltoall_mib)
    small_out, bg = torch.empty_like(small), _floats(phase.background_mib)
    for _ in range(phase.repeats):
        dist.barrier()
        add("allreduce", _timed(lambda: dist.all_reduce(big)))
        add("p2p", _p2p(rank, 0, 1, phase.p2p_mib), collective=False)
        dist.barrier()
        add("alltoall", _timed(lambda: dist.all_to_all_single(a2a_out, a2a_in)))
        dist.barrier()
        add("small_alltoall_alone", _timed(lambda: dist.all_to_all_single(small_out, small)))
        dist.barrier()
        work = dist.all_reduce(bg, group=background, async_op=True)
        time.sleep(_ISSUE_LEAD_S)
        add("small_alltoall_behind", _timed(lambda: dist.all_to_all_single(small_out, small)))
        work.wait()
    return times


def _preempt_step(rank: int, phase: Phase, step: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    label = ("before", "rate_change", "tenant")[step]
    for _ in range(phase.repeats):
        for dst, role in ((2, "target"), (1, "other")):
            seconds = _p2p(rank, 0, dst, phase.p2p_mib)
            if seconds is not None:
                times.setdefault(f"{label}_{role}", []).append(seconds)
    return times


def run_patterns(
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    phase: dict[str, Any],
    mode: Literal["model", "shaped"],
) -> dict[str, list[float]]:
    """This rank's timed transfers of ``phase`` (seconds per repeat, keyed by pattern)."""
    spec = Phase(**phase)
    emulation = EmulationConfig(network=spec.network(mode))
    background = dist.new_group(list(range(world_size))) if spec.name == "alone" else None
    times: dict[str, list[float]] = {}
    steps = 1 if spec.name == "alone" else 3
    with build_interceptor(emulation, rank, world_size, device) as interceptor:
        for step in range(steps):
            report_bench_step(rank, step)
            time.sleep(spec.settle_s)
            dist.barrier()
            with interceptor.step(step):
                if spec.name == "alone":
                    found = _alone_step(rank, spec, background)
                else:
                    found = _preempt_step(rank, spec, step)
            times.update(found)
    return times
