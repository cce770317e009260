"""The in-layer actuator on one gloo rank (a group of one: the straggler is rank 0).

- ``apply`` attaches a ZeroResize to every resizable linear layer with the plan's kept
  count, and none to the vocab embedding; ``clear`` removes them;
- ``freeze_dropped`` through ``install_freeze``: after real SGD steps with momentum and
  weight decay, the dropped columns are bitwise unchanged (parameter and momentum buffer);
  without it they drift (decay and momentum move them: the imputed gradient is 0);
- ``refresh`` re-selects the kept columns by priority (same count), local only.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal_hetero.balance.actuator import LayerOps
from colossal_hetero.balance.inlayer import InLayerPlan, Offload
from colossal_hetero.balance.ops.resize import ZeroResize
from colossal_hetero.layers.linear import ResizableLinearCol, ResizableLinearRow
from tests.dist_utils import run_distributed

K, N = 8, 6


def _model(group: dist.ProcessGroup) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        ResizableLinearCol(K, [N], group=group), nn.Tanh(), ResizableLinearRow([N], K, group=group)
    )


def _train(model: nn.Module, ops: LayerOps, freeze: bool) -> tuple[nn.Module, torch.optim.SGD]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    if freeze:
        ops.install_freeze(optimizer)
    for step in range(3):
        x = torch.randn(4, K, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _check(rank: int, world_size: int, device: torch.device) -> None:
    del rank, world_size, device
    group = dist.new_group([0])
    plan = InLayerPlan((Offload(0, "resize", 0.5, 0.0, 2.0),))
    for freeze in (True, False):
        model = _model(group)
        before = [p.detach().clone() for p in model.parameters()]
        ops = LayerOps(model)
        ops.apply(plan)
        layers = [model[0], model[2]]
        assert all(isinstance(layer.local_op, ZeroResize) for layer in layers)
        assert [layer.local_op.kept.numel() for layer in layers] == [K // 2, N // 2]
        dropped = [layer.local_op.dropped(layer) for layer in layers]
        _, optimizer = _train(model, ops, freeze)
        for layer, cols, old in zip(layers, dropped, before[::2], strict=True):
            weight = layer.weight.detach()
            same = torch.equal(weight[:, cols], old[:, cols])
            assert same == freeze, (freeze, weight[:, cols], old[:, cols])
            kept = layer.local_op.kept
            assert not torch.equal(weight[:, kept], old[:, kept])  # the kept ones train
            if freeze:
                buf = optimizer.state[layer.weight]["momentum_buffer"]
                assert torch.count_nonzero(buf[:, cols]) == 0
        ops.refresh()  # new scores: the kept count stays
        assert [layer.local_op.kept.numel() for layer in layers] == [K // 2, N // 2]
        ops.clear()
        assert all(layer.local_op is None for layer in layers) and ops.plan.empty


@pytest.mark.dist
def test_actuator_attaches_freezes_and_clears():
    run_distributed(_check, world_size=1, force_cpu=True)


def _bump(layer: nn.Module, change: list[float]) -> None:
    """Add ``change[j]`` to column j of the first output row: the column's L1 change, by hand."""
    with torch.no_grad():
        layer.weight[0] += torch.tensor(change, dtype=layer.weight.dtype)


def _top_half(scores: list[float]) -> list[int]:
    """Brute force: the columns of the len/2 highest scores (ties to the lower index)."""
    order = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
    return sorted(order[: len(scores) // 2])


def _check_history(rank: int, world_size: int, device: torch.device) -> None:
    del rank, world_size, device
    group = dist.new_group([0])
    plan = InLayerPlan((Offload(0, "resize", 0.5, 0.0, 2.0),))
    model = _model(group)
    layers = [model[0], model[2]]
    ops = LayerOps(model, priority="change")  # hand-made changes: the change rule's scores
    ops.refresh()  # first boundary: trackers snapshot the weights, no op attached
    # a period without ops: every column's change is recorded (powers of two: exact in fp32)
    before = {K: [0.25, 4.0, 0.5, 1.0, 8.0, 0.125, 2.0, 16.0], N: [2.0, 0.5, 8.0, 1.0, 4.0, 0.25]}
    for layer in layers:
        _bump(layer, before[layer.weight.shape[1]])
    ops.refresh()
    ops.apply(plan)  # the first kept half comes from that history, not from the index
    for layer in layers:
        expect = _top_half(before[layer.weight.shape[1]])
        assert layer.local_op.kept.tolist() == expect
    # a resized period: kept columns get their new change, dropped ones keep the stale score
    # even though they moved too (momentum drift is not the column's training)
    during = {K: [0.0625] * K, N: [0.0625] * N}
    scores = {}
    for layer in layers:
        width = layer.weight.shape[1]
        kept = layer.local_op.kept.tolist()
        _bump(layer, during[width])
        scores[width] = [during[width][j] if j in kept else before[width][j] for j in range(width)]
    ops.refresh()
    for layer in layers:
        assert layer.local_op.kept.tolist() == _top_half(scores[layer.weight.shape[1]])
    # a probe: ops off for a window, scores kept; re-attached at once, the same kept set
    kept_now = [layer.local_op.kept.tolist() for layer in layers]
    ops.clear()
    ops.apply(plan)
    assert [layer.local_op.kept.tolist() for layer in layers] == kept_now
    # ops off for a period at full width: every column's real change replaces its score
    ops.clear()
    after = {K: [1.0, 0.5, 4.0, 0.25, 2.0, 8.0, 0.125, 16.0], N: [0.5, 4.0, 0.25, 2.0, 8.0, 1.0]}
    for layer in layers:
        _bump(layer, after[layer.weight.shape[1]])
    ops.refresh()
    ops.apply(plan)
    for layer in layers:
        assert layer.local_op.kept.tolist() == _top_half(after[layer.weight.shape[1]])
    ops.clear()
    LayerOps(model, impute="mean").apply(plan)  # the resized ops impute the inputs' mean
    assert all(layer.local_op.impute == "mean" for layer in layers)


@pytest.mark.dist
def test_actuator_scores_from_history_survive_probe():
    run_distributed(_check_history, world_size=1, force_cpu=True)


def test_actuator_refuses_an_unknown_imputation():
    with pytest.raises(ValueError, match="impute must be one of"):
        LayerOps(nn.Linear(2, 2), impute="stale")
