"""Uneven tensor-parallel widths planned inside each pipeline stage: 4 gloo ranks, PP=2 x TP=2.

Stage 0's TP pair is a device and one at half its speed; stage 1's pair is equal. With
``plan.mode: auto`` the plugin plans each stage's widths on its own devices
(planner/stage_widths.py) and shards with them: stage 0's faster rank must hold the larger
shards (3 of 4 heads), stage 1's ranks equal ones, each exactly its stage's planned widths. Two
training steps give the losses of the same stages with even widths (plan.mode even, the same
split) within the fp32 chain tolerance: uneven widths change only the order of the sums.
"""

from __future__ import annotations

import pytest
import torch
from colossalai.booster import Booster

from colossal_hetero.config import ClusterConfig, HeteroConfig, ParallelConfig, PlanConfig
from colossal_hetero.config.schema import DeviceSpec
from colossal_hetero.models import build_model, loss_from_outputs
from colossal_hetero.plugin import HeteroParallelPlugin
from tests.dist_utils import run_distributed
from tests.distributed.test_kfkb_schedule import GPT2, _batch
from tests.tolerances import chain_atol, transformer_depth

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
        sizes = {n: p.numel() for n, p in model.unwrap().named_parameters()}
        split = list(plugin.stage_manager.num_layers_per_stage or [])
        return plugin.stage_widths, losses, sizes, split
    finally:
        plugin.close()


def _run(rank, world_size, device):
    devices = [DeviceSpec(speed=s) for s in (1.0, 0.5, 1.0, 1.0)]
    parallel = ParallelConfig(tp=2, pp=2, num_microbatches=M)
    planned = HeteroConfig(
        parallel=parallel,
        cluster=ClusterConfig(devices=devices),
        plan=PlanConfig(mode="auto", reference_tflops=1.0),
    )
    widths, losses, sizes, split = _train(planned)
    stage, tp_rank = rank // 2, rank % 2
    if stage == 0:
        assert widths["heads"] == (3, 1) and widths["ffn"][0] > widths["ffn"][1], widths
    else:
        assert len(set(widths["heads"])) == 1 and len(set(widths["ffn"])) == 1, widths
    ffn = [n for n in sizes if n.endswith("mlp.c_fc.weight")]
    hidden = GPT2.hf["n_embd"]
    assert ffn and all(sizes[n] == hidden * widths["ffn"][tp_rank] for n in ffn), (sizes, widths)
    even = HeteroConfig(
        parallel=ParallelConfig(tp=2, pp=2, num_microbatches=M, num_layers_per_stage=split),
        plan=PlanConfig(mode="even"),
    )
    none, want, even_sizes, _ = _train(even)
    assert none == {} and all(even_sizes[n] == hidden * 2 * hidden for n in ffn)
    assert len(losses) == len(want) == (2 if stage == 1 else 0)
    atol = chain_atol(transformer_depth(GPT2.hf["n_layer"]), 4 * hidden, torch.float32, 10.0)
    for got, ref in zip(losses, want, strict=True):
        assert torch.isfinite(got) and abs(got.item() - ref.item()) <= atol, (got, ref, atol)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(900)
def test_each_stage_shards_with_its_planned_widths():
    run_distributed(_run, world_size=4)
