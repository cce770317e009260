"""Online link profiling of KFKBSchedule under the emulation's model mode, on 2 gloo ranks.

A two-stage toy pipeline whose passes sleep a fixed time (40 ms forward, 80 ms backward) runs
6 steps of 8 micro-batches under one interceptor whose network model slows the stage link on a
step schedule: steps 0-1 nearly free (0.1 ms a message), steps 2-3 at 20 ms, steps 4-5 at 80 ms
a message (bandwidth preemptions). The schedule's isend/irecv go through the interceptor, so
the model books them on the link timeline, sleeps them, and counts them in the step's p2p
metrics. AdaKController retunes after steps 1, 3 and 5 from the measured records.

Load-independent: machine load reaches this test only as sleeps that wake late (the passes'
and the modelled links'; gloo's real messages are tiny and sent at once). Every sleep goes
through ``_Lateness``, which accounts how late it woke, and each bound below is its idle
margin plus what that accounted lateness can add. Checked on both ranks:

- the p2p bytes the interceptor counted equal what the schedule's boxes moved;
- the link time the controller derived from the timestamps is the modelled one, at least
  0.8x and at most 1.2x + 2 ms + the interpreter's switch interval (a landing's stamp waits
  for it) + the window's largest lateness, and grows with it;
- k: 1 on the free link while it reads under 4 ms (the simulator's gain of grouping is below
  the 3% tie band, hand-computed below), at least 2 on the 20 ms link, never smaller as the
  link slows further;
- every rank holds the same k;
- the simulator, fed each step's measured records (``predict_from_records``), predicts the
  measured step time within 15% (the issue's target) plus the step's accounted lateness over
  the measured step.
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
SECONDS = {0: FREE_S, 2: 0.02, 4: 0.08}  # step -> seconds a message takes from then on
SLOW = {at: FREE_S / seconds for at, seconds in SECONDS.items()}  # bandwidth factors


class _Lateness:
    """Sleeps, and accounts how late each one woke (actual minus asked): the host's scheduling
    delay, the one thing machine load adds to this test's passes and modelled links."""

    def __init__(self) -> None:
        self.late: list[float] = []

    def sleep(self, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.late.append(max(0.0, time.perf_counter() - start - seconds))

    def take(self) -> tuple[float, float]:
        """(total, largest) lateness since the last take."""
        late, self.late = self.late, []
        return sum(late), max(late, default=0.0)


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward sleep a fixed time: compute whose only load effect
    is the sleeps' lateness, which ``_Lateness`` accounts."""

    @staticmethod
    def forward(ctx, x, clock):  # type: ignore[override]
        ctx.clock = clock
        clock.sleep(FORWARD_S)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.clock.sleep(BACKWARD_S)
        return grad, None


class _Stage(nn.Module):
    def __init__(self, first: bool, clock: _Lateness) -> None:
        super().__init__()
        self.first, self.clock = first, clock
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, hidden_states=None):
        h = _Sleep.apply(self.lin(x if hidden_states is None else hidden_states), self.clock)
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


def _steps(rank, world_size, device, clock):
    """Run the six steps; per retuning (transfer seconds, k) and per step the prediction and
    the lateness (total, largest) of every rank's sleeps."""
    interceptor = build_interceptor(_emulation(), rank, world_size, device)
    interceptor._sleep = clock.sleep  # the modelled links sleep through the same account
    interceptor.install()
    try:
        stages = PipelineStageManager(ProcessGroupMesh(2), pipeline_axis=0)
        torch.manual_seed(0)
        model = _Stage(first=rank == 0, clock=clock)
        optimizer = OptimizerWrapper(torch.optim.SGD(model.parameters(), lr=0.0))
        schedule = KFKBSchedule(stages, num_microbatches=M, k=1)
        control = AdaKController(schedule, [0, 1], sys.float_info.max, period=2, min_gain=0.03)
        batch = {"x": torch.randn(2 * M, WIDTH)}
        decisions, steps = [], []
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
            rows: list = [None] * world_size
            dist.all_gather_object(rows, (schedule.last_record, clock.take()))
            prediction = predict_from_records([r for r, _ in rows], M, schedule.k)
            steps.append((prediction, [late for _, late in rows]))
            record = control.after_step(step)
            if record is not None:
                decisions.append((record["inputs"]["transfer_s"][0], record["decision"]["k"]))
    finally:
        interceptor.uninstall()
    ks = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(ks, torch.tensor([float(schedule.k)]))
    assert len({float(x) for x in ks}) == 1
    return decisions, steps


def _run(rank, world_size, device):
    decisions, steps = _steps(rank, world_size, device, _Lateness())
    # Machine load reaches this test only as late wake-ups from its sleeps (passes and
    # modelled links; the real gloo messages are tiny and sent at once): each bound below
    # is the idle one plus what the lateness accounted on the ranks could add.
    for (measured, modelled), step in zip(
        ((s, SECONDS[at]) for (s, _), at in zip(decisions, SECONDS, strict=True)),
        (1, 3, 5),
        strict=True,
    ):
        # A link sample is one message's landing after its release: a late wake-up moves the
        # landing by at most the largest lateness of the window's sleeps, never earlier.
        late = max(largest for _, lates in steps[step - 1 : step + 1] for _, largest in lates)
        # A message lands no sooner than the modelled time after its data moved (the
        # emulation stamps that, never early), but its send is stamped once the isend
        # returned, which a descheduled sender can stamp late: a sample can read short by
        # that (15.6 ms of 20 read once under two busy loops; the median read 18.7 or more).
        # A free link may read 0 (nothing blocked).
        lowest = 0.8 * modelled if modelled > FREE_S else 0.0
        # A landing's stamp waits for the interpreter: up to its switch interval late.
        highest = 1.2 * modelled + 0.002 + sys.getswitchinterval() + late
        assert lowest <= measured <= highest, (decisions, late)
    (free_s, k_free), (slow_s, k_slow), (slower_s, k_slower) = decisions
    assert free_s < slow_s < slower_s, decisions
    # p = 2, m = 8, 1F1B against k = 2 with c a message (c below a forward): the steps are
    # 9 (f + b) + 8 c and 9 (f + b) + 2 c, a gain of 6 c / (1.08 + 2 c): 3% (the tie band)
    # at c = 5.45 ms; below 4 ms (2.2%) k stays 1 (slower passes only shrink the gain). The
    # slow link's 20 ms, read at 10 ms or more, gains >= 4% even with passes 30% late.
    assert k_free == 1 or free_s >= 0.004, decisions
    assert (k_slow >= 2 or slow_s < 0.01) and k_slower >= k_slow >= k_free, decisions
    for prediction, lates in steps:
        # The simulator takes each stage's median pass: the step's lateness beyond it lies
        # on the critical path at most once per sleep, on either rank.
        slack = sum(total for total, _ in lates) / prediction.measured_s
        assert prediction.relative_error < 0.15 + slack, (prediction, lates)


# Until session 17 the emulation booked an early-posted receive from its post, so a step of
# the 80 ms phase could land its messages faster than the link (measured 1.22 s against a
# physical 1.43): that failed this test under load. Receives now land after their data moved.
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_measured_link_time_drives_k_in_model_mode():
    run_distributed(_run, world_size=2)
