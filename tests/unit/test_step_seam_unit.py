"""StepSeam without a process group: which forwards open a step, what closes it, controllers.

A timing-only interceptor is the clock; a plain module and torch optimizer stand in for the
booster's (the seam wraps whatever ``step`` the optimizer object has).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from colossal_hetero.emulation import CollectiveInterceptor
from colossal_hetero.metrics import rank_metrics_path, read_metrics
from colossal_hetero.plugin.seam import StepMetrics, StepSeam


class _Events:
    def __init__(self, seam: StepSeam) -> None:
        self.seam, self.log = seam, []

    def on_step_begin(self, step: int) -> None:
        self.log.append(("begin", step, self.seam.clock.stepping_here()))  # clock not started

    def on_step_end(self, step: int, timing: Any) -> None:
        self.log.append(("end", step, self.seam.clock.stepping_here()))  # clock stopped


def _setup() -> tuple[StepSeam, nn.Module, torch.optim.Optimizer, CollectiveInterceptor]:
    clock = CollectiveInterceptor(0, 1).install()
    seam = StepSeam(clock)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seam.attach(model, optimizer)
    return seam, model, optimizer, clock


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_training_forward_opens_and_optimizer_step_closes(tmp_path: Path) -> None:
    seam, model, optimizer, clock = _setup()
    try:
        events = seam.add(_Events(seam))
        seam.add(StepMetrics(seam, tmp_path, rank=0))
        model(torch.ones(1, 4))
        assert seam.open_step == 0 and clock.stepping_here()
        model(torch.ones(1, 4))  # a second forward continues the step
        assert seam.open_step == 0
        model(torch.ones(1, 4)).sum().backward()
        seam.note_loss(torch.tensor(2.0))
        seam.note_loss(torch.tensor(4.0))
        optimizer.step()
        assert seam.open_step is None and not clock.stepping_here()
        assert seam.last_timing is not None and seam.last_timing.step == 0
        assert seam.loss == 3.0  # the mean of the step's noted losses
        optimizer.zero_grad()  # plays no part
        model.eval()
        model(torch.ones(1, 4))
        model.train()
        with torch.no_grad():
            model(torch.ones(1, 4))
        with torch.inference_mode():
            model(torch.ones(1, 4))
        assert seam.open_step is None  # validation forwards open none
        _train(model, optimizer)
        assert seam.last_timing.step == 1
        assert events.log == [(e, s, False) for s in (0, 1) for e in ("begin", "end")]
    finally:
        seam.close()
        clock.uninstall()
    records = read_metrics(rank_metrics_path(tmp_path, 0))
    assert [(r.step, r.loss) for r in records] == [(0, 3.0), (1, None)]
    model(torch.ones(1, 4))  # hooks removed by close(): nothing opens
    assert seam.open_step is None


def test_explicit_steps_mix_with_the_automatic_driving() -> None:
    seam, model, optimizer, clock = _setup()
    try:
        assert seam.begin_step(7) == 7
        _train(model, optimizer)  # the forward leaves step 7 open, the optimizer closes it
        assert seam.open_step is None
        assert seam.end_step().step == 7  # the step the optimizer closed
        with pytest.raises(RuntimeError, match="without an open step"):
            seam.end_step()
        seam.begin_step()  # numbered after the last: 8, closed explicitly
        with pytest.raises(RuntimeError, match="still open"):
            seam.begin_step(9)
        assert seam.end_step().step == 8
        optimizer.step()  # nothing open: nothing happens
        assert seam.open_step is None and seam.last_timing is not None
        _train(model, optimizer)
        assert seam.last_timing.step == 9  # automatic numbering continues
    finally:
        seam.close()
        clock.uninstall()
