"""AdaKController's early decision on 2 gloo ranks: ``k`` lands one step sooner.

A two-stage toy pipeline (one linear layer per stage, m = 4). The controller retunes after every
step with a configured 5 s latency per message on the link, so the decision is known by hand:
1F1B pays the 10 s round trip twice (about 20 s), ``k = 2`` hides the second behind the other
group (about 10 s; ``k = 3`` and ``4`` differ from it by the measured milliseconds of compute,
inside the 1% tie band), so the schedule moves from ``k = 1`` to ``k = 2``.

- ``overlap`` alone: the gather after step 0 is decided after step 1, so step 1 still runs
  ``k = 1`` and step 2 runs ``k = 2``;
- ``overlap`` and ``early``: it is decided before step 1's first pass, so step 1 runs ``k = 2``.

Which ``k`` a step ran is read from the activations the stage kept at once (``peak_saved``,
``min(k (p - s), m)``); both ranks hold the same ``k``; the record names the step measured.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from colossalai.cluster import ProcessGroupMesh
from colossalai.interface import OptimizerWrapper
from colossalai.pipeline.stage_manager import PipelineStageManager
from torch import nn

from colossal_hetero.pipeline.controller import AdaKController
from colossal_hetero.pipeline.schedule import KFKBSchedule
from tests.dist_utils import run_distributed

M, WIDTH = 4, 8


class _Stage(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, hidden_states=None):
        h = self.lin(x if hidden_states is None else hidden_states)
        return {"hidden_states": h} if self.first else h


def _ks_run(early: bool, stages, model, optimizer) -> tuple[list[int], dict]:
    """Three steps from k = 1 under a controller retuning every step; the k each step ran
    (from its peak of kept activations) and the first decision record."""
    schedule = KFKBSchedule(stages, num_microbatches=M, k=1)
    group = dist.new_group(backend="gloo")
    control = AdaKController(
        schedule, [0, 1], 1e12, latency_s=5.0, period=1, group=group, overlap=True, early=early
    )
    batch = {"x": torch.randn(2 * M, WIDTH, generator=torch.Generator().manual_seed(0))}
    ran, records = [], []
    p, s = stages.num_stages, stages.stage
    for step in range(3):
        schedule.forward_backward_step(
            model, iter([batch]), lambda out, mb: out.pow(2).mean(), optimizer
        )
        ran.append(next(k for k in range(1, M + 1) if min(k * (p - s), M) == schedule.peak_saved))
        record = control.after_step(step)
        if record is not None:
            records.append(record)
    ks = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(ks, torch.tensor([float(schedule.k)]))
    assert len({float(x) for x in ks}) == 1
    return ran, records[0]


def _run(rank, world_size, device):
    stages = PipelineStageManager(ProcessGroupMesh(2), pipeline_axis=0)
    torch.manual_seed(0)
    model = _Stage(first=rank == 0)
    optimizer = OptimizerWrapper(torch.optim.SGD(model.parameters(), lr=0.0))
    late, late_record = _ks_run(False, stages, model, optimizer)
    assert late == [1, 1, 2], late
    assert late_record["step"] == 0 and late_record["decision"]["k"] == 2
    assert late_record["ran_k"] == 1 and late_record["reason"] == "model"
    soon, soon_record = _ks_run(True, stages, model, optimizer)
    assert soon == [1, 2, 2], soon
    assert soon_record["step"] == 0 and soon_record["decision"] == {"k": 2, "previous_k": 1}
    assert soon_record["model_k"] == 2 and soon_record["ran_k"] == 1
    by_k = soon_record["predicted_s_by_k"]  # what the choice compared: k = 2 beat k = 1
    assert {1, 2} <= set(by_k) and by_k[2] < by_k[1]
    assert soon_record["gather_wait_s"] >= 0.0
    assert late_record["decide_s"] > 0.0 and soon_record["decide_s"] > 0.0  # timed in _decide
    with pytest.raises(ValueError, match="^early:"):
        AdaKController(KFKBSchedule(stages, num_microbatches=M), [0, 1], 1e12, early=True)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_early_decision_lands_one_step_sooner():
    run_distributed(_run, world_size=2)
