"""A planned uneven stage split boots and trains: 2 gloo ranks, PP=2, plan.mode auto.

Stage 0's device is 4x faster than stage 1's, so the plugin plans more of the 4 GPT-2 blocks on
stage 0 (plugin/planning.py sets Colossal-AI's ``num_layers_per_stage`` before it shards). The
run must hold exactly the planned blocks on each rank, and train to the same losses, bit for
bit, as a run given that split explicitly (``parallel.num_layers_per_stage``, no planning).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from colossalai.booster import Booster

from colossal_hetero.config import ClusterConfig, HeteroConfig, ParallelConfig, PlanConfig
from colossal_hetero.config.schema import DeviceSpec, StageTimeSpec
from colossal_hetero.models import build_model, loss_from_outputs
from colossal_hetero.plugin import HeteroParallelPlugin
from tests.dist_utils import run_distributed
from tests.distributed.test_kfkb_schedule import GPT2, _batch

M = 4


def _train(config: HeteroConfig):
    plugin = HeteroParallelPlugin(config, workload=(2 * M, 16))
    try:
        torch.manual_seed(0)
        model = build_model(GPT2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        booster = Booster(plugin=plugin)
        model, optimizer, criterion, _, _ = booster.boost(model, optimizer, loss_from_outputs)
        losses = []
        for step in range(2):
            result = booster.execute_pipeline(
                iter([_batch(2 * M, seed=step)]), model, criterion, optimizer, return_loss=True
            )
            optimizer.step()
            optimizer.zero_grad()
            if result["loss"] is not None:
                losses.append(result["loss"].clone())
        names = model.unwrap().named_parameters()
        blocks = {n.split(".")[2] for n, _ in names if n.startswith("transformer.h.")}
        schedule = plugin.engine.scheduler
        ran = (schedule.num_microbatches, getattr(schedule, "k", 1))
        return plugin.stage_plan, losses, blocks, ran
    finally:
        plugin.close()


def _run(rank, world_size, device):
    devices = [DeviceSpec(speed=1.0), DeviceSpec(speed=0.25)]
    planned = HeteroConfig(
        parallel=ParallelConfig(pp=2, num_microbatches=M),
        cluster=ClusterConfig(devices=devices),
        plan=PlanConfig(mode="auto", reference_tflops=1.0),
    )
    plan, losses, blocks, _ = _train(planned)
    assert plan is not None
    split = list(plan.layers_per_stage)
    assert sum(split) == 4 and split[0] > split[1] >= 1, split  # the fast stage holds more
    held = range(split[0]) if rank == 0 else range(split[0], 4)
    assert blocks == {str(i) for i in held}, (split, blocks)
    explicit = HeteroConfig(
        parallel=ParallelConfig(pp=2, num_microbatches=M, num_layers_per_stage=split),
        plan=PlanConfig(mode="even"),
    )
    none, want, _, _ = _train(explicit)
    assert none is None
    assert len(losses) == (2 if rank == 1 else 0)
    assert all(torch.isfinite(x) for x in losses)
    assert all(map(torch.equal, losses, want)), (losses, want)
    # Planned micro-batch count and k (config 0): the schedule runs the plan's m and k, and
    # trains as 1F1B with that count given explicitly (kFkB's losses equal 1F1B's for any k).
    auto = HeteroConfig(
        parallel=ParallelConfig(pp=2, num_microbatches=0, pp_schedule="kfkb", pp_k=0),
        cluster=ClusterConfig(devices=devices),
        plan=PlanConfig(mode="auto", reference_tflops=1.0),
    )
    plan, losses, _, ran = _train(auto)
    assert ran == (plan.num_microbatches, plan.k) and 2 * M % plan.num_microbatches == 0, ran
    fixed = replace(planned.parallel, num_microbatches=plan.num_microbatches)
    _, want, _, _ = _train(replace(planned, parallel=fixed))
    assert len(losses) == (2 if rank == 1 else 0)
    assert all(map(torch.equal, losses, want)), (losses, want)
    # Measured stage times on declared-equal devices (plan.stage_times): stage 1's block 4x
    # stage 0's, so [3, 1] (30 vs 40 ms) beats [2, 2] (20 vs 80 ms): the plugin holds it.
    times = [StageTimeSpec(block_s=0.01), StageTimeSpec(block_s=0.04)]
    measured = HeteroConfig(
        parallel=ParallelConfig(pp=2, num_microbatches=M),
        plan=PlanConfig(mode="auto", reference_tflops=1.0, stage_times=times),
    )
    plan, losses, blocks, _ = _train(measured)
    assert plan is not None and list(plan.layers_per_stage) == [3, 1], plan
    assert blocks == ({"0", "1", "2"} if rank == 0 else {"3"}), blocks
    explicit = replace(explicit, parallel=replace(explicit.parallel, num_layers_per_stage=[3, 1]))
    _, want, _, _ = _train(explicit)
    assert all(map(torch.equal, losses, want)), (losses, want)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_planned_uneven_stage_split_trains():
    run_distributed(_run, world_size=2)
