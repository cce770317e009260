"""Online link profiling of KFKBSchedule under the emulation's model mode, on 2 gloo ranks.

A two-stage toy pipeline whose passes take a fixed wall time (a sleep: 40 ms forward, 80 ms
backward, whatever the machine load) runs 6 steps of 8 micro-batches under one interceptor
whose network model slows the stage link on a step schedule: steps 0-1 nearly free (0.1 ms a
message), steps 2-3 at 8 ms, steps 4-5 at 80 ms a message (bandwidth preemptions). The schedule's
isend/irecv go through the interceptor, so the model books them on the link timeline, sleeps
them, and counts them in the step's p2p metrics. AdaKController retunes after steps 1, 3 and 5
from the measured records. Checked on both ranks:

- the p2p bytes the interceptor counted equal what the schedule's boxes moved;
- the link time the controller derived from the timestamps is the modelled one (within a
  margin for sleep overshoot and scheduling), and grows with it;
- k: 1 on the free link (the simulator's gain of grouping is below the 3% tie band),
  then at least 2 (a transfer of 0.2 forward-times is worth hiding), and never smaller as the
  link slows further (80 ms is 2 forward-times, still the regime where k grows);
- every rank holds the same k;
- the simulator, fed each step's measured records (``predict_from_records``), predicts the
  measured step time within 15% (the issue's target for the simulator's validation).
"""

from __future__ import annotations

import sys
import time

import pytest
import torch
import torch.distributed as dist
from colossalai.cluster import ProcessGroupMesh
from colossalai.interface import OptimizerWrapper
from colossalai.pipeline.stage_manager import PipelineStageManager
from torch import nn

from colossal_hetero.config.schema import (
    EmulationConfig,
    NetworkEmulationConfig,
    PreemptionSpec,
)
from colossal_hetero.emulation import build_interceptor
from colossal_hetero.pipeline.controller import AdaKController
from colossal_hetero.pipeline.profile import predict_from_records
from colossal_hetero.pipeline.schedule import KFKBSchedule
from tests.dist_utils import run_distributed

FORWARD_S, BACKWARD_S = 0.04, 0.08
M, WIDTH = 8, 256
MESSAGE_BYTES = 2 * WIDTH * 4  # one micro-batch of 2 rows, fp32
FREE_S = 1e-4  # seconds a message takes on the unpreempted link
SLOW = {0: 1.0, 2: FREE_S / 0.008, 4: FREE_S / 0.08}  # step -> bandwidth factor from then on


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward take fixed wall time: compute immune to load."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        time.sleep(FORWARD_S)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(BACKWARD_S)
        return grad


class _Stage(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, hidden_states=None):
        h = _Sleep.apply(self.lin(x if hidden_states is None else hidden_states))
        return {"hidden_states": h} if self.first else h


def _emulation() -> EmulationConfig:
    gbps = MESSAGE_BYTES * 8 / FREE_S / 1e9
    preemptions = [
        PreemptionSpec(factor=SLOW[2], start_step=2, end_step=4),
        PreemptionSpec(factor=SLOW[4], start_step=4),
    ]
    return EmulationConfig(
        network=NetworkEmulationConfig(bandwidth_gbps=gbps, preemptions=preemptions)
    )


def _run(rank, world_size, device):
    interceptor = build_interceptor(_emulation(), rank, world_size, device).install()
    try:
        stages = PipelineStageManager(ProcessGroupMesh(2), pipeline_axis=0)
        torch.manual_seed(0)
        model = _Stage(first=rank == 0)
        optimizer = OptimizerWrapper(torch.optim.SGD(model.parameters(), lr=0.0))
        schedule = KFKBSchedule(stages, num_microbatches=M, k=1)
        # A 3% tie band: the free link's measured time is real gloo delivery on a busy host
        # (up to a millisecond or two), whose predicted gain stays below it; 8 ms gains 4%.
        control = AdaKController(schedule, [0, 1], sys.float_info.max, period=2, min_gain=0.03)
        batch = {"x": torch.randn(2 * M, WIDTH)}
        decisions, errors = [], []
        for step in range(6):
            interceptor.begin_step(step)
            schedule.forward_backward_step(
                model, iter([batch]), lambda out, mb: out.pow(2).mean(), optimizer
            )
            timing = interceptor.end_step()
            stats = schedule.last_stats
            assert stats is not None
            # The interceptor saw every isend the boxes issued (tensor bytes plus headers).
            assert timing.bytes_by_kind["p2p"] == stats.sent_bytes >= M * MESSAGE_BYTES
            assert timing.wait_by_kind["p2p"] > 0
            records: list = [None] * world_size
            dist.all_gather_object(records, schedule.last_record)
            errors.append(predict_from_records(records, M, schedule.k).relative_error)
            record = control.after_step(step)
            if record is not None:
                decisions.append((record["inputs"]["transfer_s"][0], record["decision"]["k"]))
    finally:
        interceptor.uninstall()
    (free_s, k_free), (slow_s, k_slow), (slower_s, k_slower) = decisions
    assert free_s < slow_s < slower_s, decisions
    for measured, modelled in ((slow_s, 0.008), (slower_s, 0.08)):
        # Sleeps overshoot and ranks get descheduled (on a loaded host by many ms): later,
        # never much earlier.
        assert 0.8 * modelled <= measured <= 1.5 * modelled + 0.01, decisions
    assert k_free == 1 and k_slow >= 2 and k_slower >= k_slow, decisions
    assert max(errors) < 0.15, errors
    ks = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(ks, torch.tensor([float(schedule.k)]))
    assert len({float(x) for x in ks}) == 1


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_measured_link_time_drives_k_in_model_mode():
    run_distributed(_run, world_size=2)
