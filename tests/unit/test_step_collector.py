"""``gc.every``: Python's garbage collection off inside steps, one full collection every N steps
at the seam, the same steps on every rank; the collector restored as found on close.

A real ``StepSeam`` driven by a plain module and optimizer (as ``test_step_seam_unit``); a
``gc.callbacks`` hook counts the collections that ran and whether a step was open then.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from colossal_hetero.emulation import CollectiveInterceptor
from colossal_hetero.plugin.seam import StepSeam
from colossal_hetero.utils.collector import StepCollector


@pytest.fixture
def collector_state() -> Iterator[None]:
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


class _Cycle:
    """Garbage only the cycle collector frees (it refers to itself)."""

    def __init__(self) -> None:
        self.me = self


def _run(every: int, steps: int) -> tuple[StepCollector, list[tuple[int | None, int]], list]:
    clock = CollectiveInterceptor(0, 1).install()
    seam = StepSeam(clock)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seam.attach(model, optimizer)
    collector = seam.add(StepCollector(every))
    seen: list[tuple[int | None, int]] = []  # (open step, generation) per collection
    during: list[bool] = []  # gc enabled, sampled inside each step

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "stop":
            seen.append((seam.open_step, info["generation"]))

    gc.collect()  # allocation counts start from 0: nothing is due before the first step opens
    gc.callbacks.append(callback)
    try:
        for _ in range(steps):
            model(torch.ones(3, 4)).sum().backward()
            during.append(gc.isenabled())
            for _ in range(3000):  # enough allocations to trigger automatic collections
                _Cycle()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        gc.callbacks.remove(callback)
        seam.close()
        clock.uninstall()
    return collector, seen, during


def test_collections_run_only_between_steps_every_n(collector_state: None) -> None:
    gc.enable()
    collector, seen, during = _run(every=2, steps=5)
    assert during == [False] * 5  # automatic collection off inside every step
    # One full collection after steps 1 and 3 (the 2nd and 4th), none inside a step or
    # automatic: without the controller, 15,000 cyclic objects trigger dozens.
    assert seen == [(None, 2), (None, 2)]
    assert collector.collections == 2 and collector.collected_s >= 0.0
    assert gc.isenabled()  # restored on close


def test_close_leaves_a_disabled_collector_disabled_and_bad_every_is_refused(
    collector_state: None,
) -> None:
    gc.disable()
    collector, seen, _ = _run(every=1, steps=2)
    assert [g for _, g in seen] == [2, 2] and collector.collections == 2
    assert not gc.isenabled()
    with pytest.raises(ValueError, match="gc.every"):
        StepCollector(0)


def test_without_the_controller_the_same_loop_collects_automatically(
    collector_state: None,
) -> None:
    """The reference the first test is measured against: its loop does trigger collections."""
    gc.enable()
    seen: list[int] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "stop":
            seen.append(info["generation"])

    gc.callbacks.append(callback)
    try:
        for _ in range(5 * 3000):
            _Cycle()
    finally:
        gc.callbacks.remove(callback)
    assert len(seen) >= 5
