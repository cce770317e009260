"""``balancer.freeze_dropped`` both ways, through the plugin: config -> ``build_balancer`` ->
``LayerOps.install_freeze`` on the booster's optimizer -> a real AdamW step.

Two gloo ranks, TP=2, a tiny GPT-2 (Conv1D layers: the reduction dim is 0), mode resize, no
emulation and agreements far apart, so the controller never acts on its own. One step with
every column computed builds AdamW's moments; then rank 1 is ZERO-resized to half its
reduction columns (the controller's own ``LayerOps``) and one more step runs. On rank 1's
dropped columns:

- ``freeze_dropped: true``: the weight and both moments are bitwise those after step 1;
- ``freeze_dropped: false``: the gradient there is the imputed 0, so AdamW moves them by
  momentum and decoupled decay alone; checked against that update written out in float64.

The kept columns train in both settings; rank 0 gets no op and trains every column. GPT-2's
LM head shares its weight with the input embedding, whose gradient reaches the head's dropped
columns too: they are frozen like the others, but unfrozen they are not a zero-gradient
update, so only their drift is checked.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from colossalai.booster import Booster

from colossal_hetero.balance.inlayer import InLayerPlan, Offload
from colossal_hetero.balance.ops import ZeroResize, reduction_dim
from colossal_hetero.config.schema import BalancerConfig, HeteroConfig, ParallelConfig
from colossal_hetero.layers.linear import ResizableParallelModule
from colossal_hetero.models import build_model, loss_from_outputs
from colossal_hetero.plugin import HeteroParallelPlugin
from tests.dist_utils import run_distributed
from tests.tiny_models import GPT2
from tests.tolerances import unit_roundoff

LR, WD, BETAS, EPS = 0.05, 0.1, (0.9, 0.999), 1e-8
STRAGGLER = 1


def _batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _adamw_on_zero_grad(p1: torch.Tensor, m1: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    """AdamW's second step (t = 2) where the gradient is 0, in float64:
    m = b1 m1, v = b2 v1, p = p1 (1 - lr wd) - lr / (1 - b1^2) * m / (sqrt(v / (1 - b2^2)) + eps).
    """
    b1, b2 = BETAS
    m, v = b1 * m1.double(), b2 * v1.double()
    denom = v.sqrt() / math.sqrt(1 - b2**2) + EPS
    return p1.double() * (1 - LR * WD) - LR / (1 - b1**2) * m / denom


def _one_setting(rank: int, freeze: bool) -> None:
    balancer = BalancerConfig(mode="resize", freeze_dropped=freeze, every=1000, window=1000)
    config = HeteroConfig(parallel=ParallelConfig(tp=2), balancer=balancer)
    plugin = HeteroParallelPlugin(config, workload=(4, 16))
    try:
        torch.manual_seed(0)
        model = build_model(GPT2)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD
        )
        booster = Booster(plugin=plugin)
        model, optimizer, criterion, _, _ = booster.boost(model, optimizer, loss_from_outputs)
        inner: Any = getattr(optimizer, "optim", optimizer)

        def step(index: int) -> None:
            batch = _batch(index)
            booster.backward(criterion(model(**batch), batch), optimizer)
            optimizer.step()
            optimizer.zero_grad()

        step(0)  # every column computed: AdamW's moments everywhere
        layers = [m for m in model.unwrap().modules() if isinstance(m, ResizableParallelModule)]
        after1 = {id(lay): _snapshot(lay, inner) for lay in layers}
        assert plugin.balancer is not None
        plugin.balancer.actuator.ops.apply(
            InLayerPlan((Offload(STRAGGLER, "resize", 0.5, 0.0, 4.0),))
        )
        step(1)
        resized = [lay for lay in layers if isinstance(lay.local_op, ZeroResize)]
        if rank != STRAGGLER:  # the actuator attaches no op here: everything trained
            assert not resized
            assert all(not torch.equal(lay.weight, after1[id(lay)][0]) for lay in layers)
            return
        assert len(resized) >= 4  # attention and MLP, column- and row-parallel
        embedding = model.unwrap().get_input_embeddings().weight
        for layer in resized:
            tied = layer.weight is embedding  # GPT-2's LM head: also the embedding's gradient
            _check_layer(layer, inner, after1[id(layer)], freeze, tied)
    finally:
        plugin.close()


def _snapshot(layer: ResizableParallelModule, inner: Any) -> tuple[torch.Tensor, ...]:
    state = inner.state[layer.weight]
    return tuple(t.detach().clone() for t in (layer.weight, state["exp_avg"], state["exp_avg_sq"]))


def _check_layer(
    layer: ResizableParallelModule,
    inner: Any,
    before: tuple[torch.Tensor, ...],
    freeze: bool,
    tied: bool,
) -> None:
    dim = reduction_dim(layer)
    op = layer.local_op
    assert isinstance(op, ZeroResize)
    dropped = op.dropped(layer)
    p1, m1, v1 = before
    state = inner.state[layer.weight]
    now = (layer.weight.detach(), state["exp_avg"], state["exp_avg_sq"])
    kept = op.kept
    assert dropped.numel() == kept.numel()  # half of the reduction columns
    assert not torch.equal(now[0].index_select(dim, kept), p1.index_select(dim, kept))

    def cols(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(dim, dropped)

    if freeze:
        for got, old in zip(now, before, strict=True):
            assert torch.equal(cols(got), cols(old))
        return
    assert not torch.equal(cols(now[0]), cols(p1))  # the dropped columns did drift
    if tied:  # the embedding's gradient reaches the dropped columns: not a zero gradient
        return
    expected = _adamw_on_zero_grad(cols(p1), cols(m1), cols(v1))
    # fp32: the decay multiply, the moments' scalings, sqrt, two divisions, the add and the
    # subtract each round once (<= 8 u relative) on terms bounded by |p1| + lr/(1-b1^2)*|m|/denom
    bound = float(cols(p1).abs().max()) + float((expected - cols(p1).double()).abs().max()) + LR
    atol = 8 * unit_roundoff(torch.float32) * bound
    torch.testing.assert_close(cols(now[0]).double(), expected, rtol=0.0, atol=atol)


def _check(rank: int, world_size: int, device: torch.device) -> None:
    del world_size, device
    for freeze in (True, False):
        _one_setting(rank, freeze)


@pytest.mark.dist
@pytest.mark.slow  # two plugin set-ups: 45 s on the loaded 2-core machine, 17 s of CPU
def test_freeze_dropped_both_settings_through_the_plugin():
    run_distributed(_check, world_size=2, force_cpu=True)
