"""Several CollectiveInterceptors in one process: one wrapper layer, calls routed by open step.

A one-rank gloo group in this process (no spawn) lets the wrapped collectives really run.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from colossal_hetero.config.schema import EmulationConfig, NetworkEmulationConfig, SlowdownSpec
from colossal_hetero.emulation import WRAPPED_NAMES, CollectiveInterceptor, build_interceptor
from colossal_hetero.emulation.router import CollectiveRouter
from colossal_hetero.utils.teardown import close_process_group

CPU = torch.device("cpu")
SLOW = EmulationConfig(compute=[SlowdownSpec(rank=0, factor=2.0)])


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(folder, 'init')}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            close_process_group()


def test_two_installed_interceptors_share_one_wrapper_layer() -> None:
    originals = {(m, n): getattr(m, n) for m in (dist, c10d) for n in WRAPPED_NAMES}
    first, second = CollectiveInterceptor(0, 1).install(), CollectiveInterceptor(0, 1).install()
    router = CollectiveRouter.shared()
    assert router.installed and router.attached == (first, second)
    for (module, name), original in originals.items():
        assert getattr(module, name).__wrapped__ is original  # wrapped once, not nested
    first.uninstall()
    assert not first.installed and second.installed
    assert all(getattr(m, n) is not fn for (m, n), fn in originals.items())  # still wrapped
    second.uninstall()
    assert all(getattr(m, n) is fn for (m, n), fn in originals.items())  # exact originals
    assert not CollectiveRouter.shared().installed  # nothing remains once all are gone


@pytest.mark.usefixtures("one_rank_group")
def test_calls_go_to_the_interceptor_whose_step_is_open() -> None:
    buf = torch.ones(4)
    with CollectiveInterceptor(0, 1) as a, CollectiveInterceptor(0, 1) as b:
        dist.all_reduce(buf)  # no step open: runs unchanged, counted by nobody
        with a.step(0):
            dist.all_reduce(buf)
            dist.all_reduce(buf)
            with pytest.raises(RuntimeError, match="another plugin's step is open"):
                b.begin_step(0)
        with b.step(0):
            dist.all_reduce(buf)
    assert a.last_timing is not None and a.last_timing.num_collectives == 2
    assert b.last_timing is not None and b.last_timing.num_collectives == 1
    assert torch.equal(buf, torch.ones(4))  # one rank: the sum is the tensor itself


def test_conflicting_emulation_is_refused_and_installs_nothing() -> None:
    slow = build_interceptor(SLOW, 0, 2, CPU).install()
    try:
        other = EmulationConfig(compute=[SlowdownSpec(rank=0, factor=3.0)])
        refused = build_interceptor(other, 0, 2, CPU)
        with pytest.raises(ValueError, match=r"^emulation\.compute: differs from another plugin's"):
            refused.install()
        assert not refused.installed and CollectiveRouter.shared().attached == (slow,)
        # Rank 1 refuses too, though its own slowdown is the same (none) in both: the verdict
        # is the world's, so no rank goes on to make process groups the others never join.
        with pytest.raises(ValueError, match=r"^emulation\.compute: differs"):
            build_interceptor(other, 1, 2, CPU).install()
        # The same emulation fits beside it, and so do parts that are off: no emulation
        # (timing only), or only links (the slowdown is off there).
        same = build_interceptor(SLOW, 0, 2, CPU).install()
        timing_only = build_interceptor(EmulationConfig(), 0, 2, CPU).install()
        link = build_interceptor(_link(1.0), 0, 2, CPU).install()
        assert CollectiveRouter.shared().attached == (slow, same, timing_only, link)
        with pytest.raises(ValueError, match=r"^emulation\.network: differs"):
            build_interceptor(_link(2.0), 0, 2, CPU).install()
        for interceptor in (same, timing_only, link):
            interceptor.uninstall()
    finally:
        slow.uninstall()
    assert not CollectiveRouter.shared().installed


def _link(gbps: float) -> EmulationConfig:
    return EmulationConfig(network=NetworkEmulationConfig(bandwidth_gbps=gbps))
