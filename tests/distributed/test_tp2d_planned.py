"""plan.tp2d written by the planner and applied by the plugin (``parallel.tp_mode: 2d`` with
unequal ``cluster.devices``), against the pure planner and the dense model.

4 gloo ranks (tp 4, dp 1; run in test_tp2d_plugin's default spawn) and 8 (tp 4 x dp 2, 2 x 2
meshes inside data parallelism; slow): the plugin's ``plan_2d`` equals ``plan_tp2d`` computed
by hand from the speeds and TP groups; every rank sits at the planned mesh position, the same
one for the k-th rank of each TP group; the first step's loss and every gradient (gathered to
the full HF tensor) equal the dense model's on the whole batch (with dp 2: the mean of the
replicas' losses, as DDP averages); the planned blocks are uneven. Float64; tolerance from
``tests.tolerances`` as in test_tp2d_plugin.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from colossalai.booster import Booster

from colossal_hetero.config import ClusterConfig, DeviceSpec, HeteroConfig, ParallelConfig
from colossal_hetero.models import loss_from_outputs
from colossal_hetero.planner.tp2d_plan import dims_2d, plan_tp2d
from colossal_hetero.plugin import HeteroParallelPlugin
from colossal_hetero.tp2d.state import spec_of
from tests.dist_utils import run_distributed
from tests.distributed.test_tp2d_plugin import (
    ATOL,
    GPT2_V,
    HEADS,
    SEQ,
    H,
    _batch,
    _dense_loss,
    _gpt2,
    _llama,
    _llama_reference,
)

BATCH = 6  # per data-parallel group: lets the planner split the rows unevenly


def _speeds(world_size: int) -> list[float]:
    slow = [1.0, 1.0, 1.0, 0.5]
    return slow + [1.0] * (world_size - 4)  # the second replica's devices are all fast


def _boost_planned(dense: Any, speeds: list[float], workload: tuple[int, int]) -> tuple:
    """(plugin, booster, model, optimizer, criterion): ``dense`` boosted in 2D on devices of
    ``speeds``, planned from ``workload`` as the trainer does."""
    config = HeteroConfig(
        parallel=ParallelConfig(tp=4, tp_mode="2d"),
        cluster=ClusterConfig(device="cpu", devices=[DeviceSpec(speed=s) for s in speeds]),
    )
    plugin = HeteroParallelPlugin(config, workload=workload)
    booster = Booster(plugin=plugin)
    optimizer = torch.optim.SGD(dense.parameters(), lr=0.1)
    model, optimizer, criterion, _, _ = booster.boost(dense, optimizer, loss_from_outputs)
    return plugin, booster, model, optimizer, criterion


def _assert_grads_equal(model: Any, reference: Any) -> None:
    """Every gradient, gathered to its full HF tensor, equals the dense reference's."""
    grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, param in model.unwrap().named_parameters():
        full = spec_of(param).gather(param.grad)
        torch.testing.assert_close(full, grads[name], rtol=0, atol=ATOL, msg=name)


def check_planned_2d(rank: int, world_size: int) -> None:
    """The checks of the module docstring (called in test_tp2d_plugin's 4-rank spawn too)."""
    speeds = _speeds(world_size)
    dp = world_size // 4
    reference = _gpt2()
    plugin, booster, model, optimizer, criterion = _boost_planned(
        _gpt2(), speeds, (BATCH * dp, SEQ)
    )
    groups = [tuple(range(g * 4, g * 4 + 4)) for g in range(dp)]
    expected = plan_tp2d(speeds, groups, BATCH, HEADS, 4 * H, GPT2_V)
    assert plugin.plan_2d == expected
    assert expected.predicted_speedup > 1.0
    assert len(set(expected.batch_sizes)) > 1 or len(set(expected.head_counts)) > 1
    mesh = model.unwrap().mesh
    assert (mesh.i, mesh.j) == expected.index_positions[rank % 4]
    positions = [None] * world_size
    dist.all_gather_object(positions, (mesh.i, mesh.j))
    assert positions == [expected.index_positions[r % 4] for r in range(world_size)]

    whole = _batch(5, batch=BATCH * dp)
    shards = [{k: v[BATCH * r : BATCH * (r + 1)] for k, v in whole.items()} for r in range(dp)]
    mine = shards[rank // 4]
    loss = criterion(model(**mine), mine)
    booster.backward(loss, optimizer)
    ref_loss = sum(_dense_loss(reference, shard) for shard in shards) / dp
    ref_loss.backward()
    own = _dense_loss(_gpt2(), mine)
    torch.testing.assert_close(loss.detach(), own.detach(), rtol=0, atol=ATOL)
    _assert_grads_equal(model, reference)
    plugin.close()


def check_planned_llama_2d(rank: int) -> None:
    """Llama (grouped-query attention) planned the same way on 4 ranks: the plugin's plan is
    ``plan_tp2d`` with Llama's dimensions and head unit (whole key/value groups per column),
    the rows are uneven, and the loss and every gradient equal the dense float64 model's."""
    speeds = _speeds(4)
    reference = _llama_reference()
    plugin, booster, model, optimizer, criterion = _boost_planned(_llama(), speeds, (BATCH, SEQ))
    heads, ffn, vocab, unit = dims_2d(reference.config)
    assert unit == 2  # 4 query heads over 2 key/value heads
    expected = plan_tp2d(speeds, [(0, 1, 2, 3)], BATCH, heads, ffn, vocab, head_unit=unit)
    assert plugin.plan_2d == expected
    assert len(set(expected.batch_sizes)) > 1
    assert all(a % unit == 0 for a in expected.head_counts)
    mesh = model.unwrap().mesh
    assert (mesh.i, mesh.j) == expected.index_positions[rank]
    batch = _batch(7, batch=BATCH)
    loss = criterion(model(**batch), batch)
    booster.backward(loss, optimizer)
    ref_loss = _dense_loss(reference, batch)
    ref_loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=0, atol=ATOL)
    _assert_grads_equal(model, reference)
    plugin.close()


def _run(rank: int, world_size: int, device: torch.device) -> None:
    check_planned_2d(rank, world_size)


@pytest.mark.slow
def test_planned_2d_inside_data_parallelism() -> None:
    run_distributed(_run, 8, force_cpu=True)
