"""Frozen columns restart at 0 through the actuator (one gloo rank, the straggler is rank 0).

``LayerOps.apply`` ZERO-resizes a column- and a row-parallel layer to half their reduction
columns, ``install_freeze`` wraps a real AdamW, two steps train; ``clear`` removes the ops
and the next step restarts the dropped columns. Reference, by hand in float64 from that
step's gradient ``g``: the columns were dropped from the first step, so their first and
second moments are 0 until the return (state created under the freeze is zeroed there); at
step t = 3 AdamW from weight 0 with ``m = (1 - b1) g``, ``v = (1 - b2) g^2`` gives
``-lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)`` (weight decay of 0 is 0).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal_hetero.balance.actuator import LayerOps
from colossal_hetero.balance.inlayer import InLayerPlan, Offload
from colossal_hetero.layers.linear import ResizableLinearCol, ResizableLinearRow
from tests.dist_utils import run_distributed

K, N = 8, 6
LR, BETAS, EPS = 0.05, (0.9, 0.999), 1e-8


def _step(model: nn.Module, step: int) -> None:
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(step))
    model(x).tanh().square().sum().backward()


def _check(rank: int, world_size: int, device: torch.device) -> None:
    del rank, world_size, device
    group = dist.new_group([0])
    torch.manual_seed(0)
    model = nn.Sequential(
        ResizableLinearCol(K, [N], group=group), nn.Tanh(), ResizableLinearRow([N], K, group=group)
    )
    layers = [model[0], model[2]]
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.1, foreach=False
    )
    ops = LayerOps(model)
    ops.install_freeze(optimizer)
    ops.apply(InLayerPlan((Offload(0, "resize", 0.5, 0.0, 2.0),)))
    dropped = [layer.local_op.dropped(layer) for layer in layers]
    before = [
        layer.weight.detach()[:, cols].clone() for layer, cols in zip(layers, dropped, strict=True)
    ]
    for step in range(2):
        _step(model, step)
        optimizer.step()
        optimizer.zero_grad()
    for layer, cols, old in zip(layers, dropped, before, strict=True):
        assert torch.equal(layer.weight.detach()[:, cols], old)  # frozen while dropped
        assert bool(old.ne(0).all())
    ops.clear()
    _step(model, 2)
    grads = [
        layer.weight.grad[:, cols].double() for layer, cols in zip(layers, dropped, strict=True)
    ]
    optimizer.step()
    b1, b2 = BETAS
    for layer, cols, g in zip(layers, dropped, grads, strict=True):
        m_hat = (1 - b1) * g / (1 - b1**3)
        v_hat = (1 - b2) * g.square() / (1 - b2**3)
        expected = -LR * m_hat / (v_hat.sqrt() + EPS)
        got = layer.weight.detach()[:, cols].double()
        # fp32: each of AdamW's ~8 roundings is <= 2^-24 relative on terms of size <= LR * 1.1
        torch.testing.assert_close(got, expected, rtol=0, atol=8 * 2**-24 * LR * 1.1)
        assert float(got.abs().max()) < LR * 1.01  # a fresh Adam step, not the old weights


@pytest.mark.dist
def test_actuator_restarts_frozen_columns_when_the_ops_come_off():
    run_distributed(_check, world_size=1, force_cpu=True)
