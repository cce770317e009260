"""SFB gradients equal the all-reduce path's, for single layers and through the plugin.

Layer checks (float64, 2 gloo ranks with different token counts, one rank with a different
batch size, and one case where a rank has no tokens): each rank's loss is scaled as the trainer
scales uneven shares. The SFB gradient must equal (a) a dense single-process reference, the
gradient of the mean over ranks of the scaled losses, which every rank computes from every
rank's inputs, and (b) what torch DDP's all-reduce gives; both to 1e-12. Replicas must be
bitwise equal. Checked for nn.Linear (with and without bias), GPT-2's Conv1D (weight [in, out]),
a module called twice in one forward, SFB next to DDP in one model, and hook removal.

End to end (fp32): a tiny GPT-2 through HeteroParallelPlugin with dp 2, tp 1 and a
``megatron_sfb`` plan whose linears sync by SFB, uneven batch shares; after one SGD step every
parameter equals a run of the same plan with all-reduce instead (the two paths sum the SFB
weights' gradients over tokens in different orders: tests/tolerances.py's sum_order bound).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from colossalai.booster import Booster
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers.pytorch_utils import Conv1D

from colossal_hetero.comm import METHODS
from colossal_hetero.comm.sfb import exclude_from_ddp, install_sfb
from colossal_hetero.config import HeteroConfig, ModelConfig, ParallelConfig
from colossal_hetero.config.loader import ConfigError
from colossal_hetero.data import shard_batch_by_shares, share_loss_scale
from colossal_hetero.models import build_hf_config, build_model, loss_from_outputs
from colossal_hetero.planner import ClusterSpec, Plan, model_spec_from_hf, search_plan
from colossal_hetero.plugin import HeteroParallelPlugin, prepare_device
from colossal_hetero.plugin.grad_sync import planned_sfb
from colossal_hetero.training.steps import forward_backward
from tests.dist_utils import run_distributed
from tests.tolerances import chain_atol, sum_order_atol, unit_roundoff

K, N = 6, 4
# float64: a forward and a backward sum (depth 2) of <= 32 terms (tokens of both ranks, or K
# features), each a product of N(0, 1) draws scaled by at most 6 (|x| < 6 in these seeds).
TOL = {"rtol": 0.0, "atol": chain_atol(2, 32, torch.float64, 32 * 36.0)}  # ~1.6e-11
TOKEN_CASES = [
    ((3, 5), (1, 2)),  # (batch, seq) of rank 0 and rank 1: 15 and 2 tokens
    ((2, 3), (2, 0)),  # rank 1 has no tokens
]
GPT2 = ModelConfig(
    arch="gpt2",
    hf={
        "n_layer": 2,
        "n_embd": 32,
        "n_head": 4,
        "n_positions": 32,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
)


class _Twice(nn.Module):
    """One linear applied twice: its gradient sums both calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(K, K)
        self.out = nn.Linear(K, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lin(torch.tanh(self.lin(x))))


def _model(kind: str) -> nn.Module:
    torch.manual_seed(7)
    models = {
        "linear": lambda: nn.Sequential(nn.Linear(K, N)),
        "linear_no_bias": lambda: nn.Sequential(nn.Linear(K, N, bias=False)),
        "conv1d": lambda: nn.Sequential(Conv1D(N, K)),
        "mixed": lambda: nn.Sequential(nn.Linear(K, K), nn.Tanh(), Conv1D(N, K)),
        "twice": _Twice,
    }
    return models[kind]().double()


SFB_MODULES = {"linear": ["0"], "linear_no_bias": ["0"], "conv1d": ["0"], "mixed": ["2"]}
SFB_MODULES["twice"] = ["lin", "out"]


def _inputs(rank: int, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(*shape, K, generator=generator, dtype=torch.float64)
    upstream = torch.randn(*shape, N, generator=generator, dtype=torch.float64)
    return x, upstream


def _scales(shapes) -> list[float]:
    """The trainer's uneven-share loss scale, ``dp * n_r / sum(n)``, by token counts."""
    tokens = [b * s for b, s in shapes]
    return [len(tokens) * t / sum(tokens) for t in tokens]


def _loss(model: nn.Module, rank: int, shapes) -> torch.Tensor:
    x, upstream = _inputs(rank, shapes[rank])
    return (model(x) * upstream).sum() * _scales(shapes)[rank]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _reference(kind: str, shapes) -> dict[str, torch.Tensor]:
    """Gradient of the mean over ranks of the scaled losses, in one process."""
    model = _model(kind)
    sum(_loss(model, r, shapes) for r in range(len(shapes))).div(len(shapes)).backward()
    return _grads(model)


def _ddp(kind: str, rank: int, shapes, group) -> dict[str, torch.Tensor]:
    model = _model(kind)
    wrapped = DistributedDataParallel(model, process_group=group)  # alive through backward
    _loss(wrapped, rank, shapes).backward()
    return _grads(model)


def _sfb(kind, rank, shapes, group, method, *, exclude: bool = True):
    model = _model(kind)
    names = SFB_MODULES[kind]
    if exclude:  # the others stay with DDP (kind "mixed")
        exclude_from_ddp(model, [f"{n}.{p}" for n in names for p in ("weight", "bias")])
    handle = install_sfb(model, dict.fromkeys(names, method), group=group)
    wrapped = DistributedDataParallel(model, process_group=group) if kind == "mixed" else model
    _loss(wrapped, rank, shapes).backward()
    return model, handle, _grads(model)


def _assert_replicas_equal(grads: dict[str, torch.Tensor], group) -> None:
    for name, grad in grads.items():
        gathered = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, grad.contiguous(), group=group)
        for other in gathered:
            assert torch.equal(other, gathered[0]), f"{name}: replicas differ"


def _check_layers(rank: int, group) -> None:
    for shapes in TOKEN_CASES:
        for kind in SFB_MODULES:
            expected = _reference(kind, shapes)
            has_tokens = all(b * s for b, s in shapes)
            if has_tokens:  # DDP on an empty batch still works, but reference suffices there
                ddp = _ddp(kind, rank, shapes, group)
                for name in expected:
                    torch.testing.assert_close(ddp[name], expected[name], **TOL, msg=name)
            for method in METHODS:
                model, handle, grads = _sfb(kind, rank, shapes, group, method)
                assert grads.keys() == expected.keys()
                for name, grad in grads.items():
                    msg = f"{kind} {shapes} {method} {name}"
                    torch.testing.assert_close(grad, expected[name], **TOL, msg=msg)
                _assert_replicas_equal(grads, group)
                # Removed hooks: gradients are local again (no collective runs).
                handle.remove()
                model.zero_grad(set_to_none=True)
                _loss(model, rank, shapes).backward()
                local = _model(kind)
                _loss(local, rank, shapes).backward()
                for name, grad in _grads(local).items():
                    torch.testing.assert_close(model.get_parameter(name).grad, grad, **TOL)


def _sfb_plan() -> Plan:
    """A plan where SFB pays: 4 samples of 4 tokens, a slow link, one slow device."""
    spec = model_spec_from_hf(build_hf_config(GPT2), batch_size=4, seq_len=4, dtype_bytes=4)
    cluster = ClusterSpec.from_relative([1.0, 0.5], reference_flops=1e9, bandwidth_gbps=0.1)
    return search_plan(cluster, spec, tp_size=1, space="megatron_sfb")


def _without_sfb(plan: Plan) -> Plan:
    layers = tuple(
        replace(la, grad_sync="allreduce") if la.grad_sync == "sfb" else la for la in plan.layers
    )
    return replace(plan, layers=layers)


def _step(plan: Plan, rank: int) -> dict[str, torch.Tensor]:
    """One SGD step of the tiny GPT-2 on this rank's uneven share; the parameters after it."""
    plugin = HeteroParallelPlugin(HeteroConfig(parallel=ParallelConfig(dp=2)), plan=plan)
    try:
        model = build_model(GPT2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        booster = Booster(plugin=plugin)
        model, optimizer, criterion, _, _ = booster.boost(model, optimizer, loss_from_outputs)
        sfb_params = {
            f"{m}.{p}"
            for la in plan.layers
            if la.grad_sync == "sfb"
            for m in la.modules
            for p in ("weight", "bias")
        }
        assert model.module.parameters_to_ignore == sfb_params  # DDP leaves them to SFB
        assert (plugin.grad_sync is None) == (not sfb_params)
        generator = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, 256, (plan.batch_size, plan.seq_len), generator=generator)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        shares = list(plan.group_samples)
        local = shard_batch_by_shares(batch, shares, rank)
        scale = share_loss_scale(shares, rank)
        forward_backward(
            booster, model, optimizer, criterion, local, use_pipeline=False, loss_scale=scale
        )
        optimizer.step()
        return {k: v.detach().clone() for k, v in model.unwrap().state_dict().items()}
    finally:
        plugin.close()


def _check_plugin(rank: int, device: torch.device) -> None:
    prepare_device(device)
    plan = _sfb_plan()
    assert any(la.grad_sync == "sfb" for la in plan.layers), "the plan should use SFB"
    assert len(set(plan.group_samples)) > 1, "shares should be uneven"
    with_sfb, without = _step(plan, rank), _step(_without_sfb(plan), rank)
    initial = build_model(GPT2).state_dict()
    assert not torch.equal(
        without["transformer.h.0.mlp.c_fc.weight"], initial["transformer.h.0.mlp.c_fc.weight"]
    )  # the step moved the weights
    # The paths differ only in the SFB weights' final sum over the 16 tokens (one rank's partial
    # sums plus the other's, or all tokens at once): a sum_order bound whose terms are taken
    # as large as the largest gradient, times lr 0.5, plus each update's rounding (u |w|).
    grad_scale = max(float((initial[n] - v).abs().max()) for n, v in without.items()) / 0.5
    weight_scale = max(float(v.abs().max()) for v in without.values())
    atol = 0.5 * sum_order_atol(16, torch.float32, 16 * grad_scale)
    atol += 2 * unit_roundoff(torch.float32) * weight_scale
    for name, value in without.items():
        torch.testing.assert_close(with_sfb[name], value, rtol=0.0, atol=atol, msg=name)


def _checks(rank: int, world_size: int, device: torch.device) -> None:
    _check_layers(rank, dist.new_group(list(range(world_size)), backend="gloo"))  # CPU tensors
    _check_plugin(rank, device)


@pytest.mark.numerics
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_sfb_gradients_equal_allreduce_for_layers_and_through_the_plugin():
    run_distributed(_checks, world_size=2)


def test_plugin_refuses_sfb_plans_without_ddp():
    plan = _sfb_plan()
    assert planned_sfb(plan, ParallelConfig(dp=2), 2)
    assert planned_sfb(_without_sfb(plan), ParallelConfig(dp=2), 2) == {}
    assert planned_sfb(plan, ParallelConfig(), 1) == {}  # one replica: nothing to sync
    for parallel in (
        ParallelConfig(dp=2, zero_stage=1, precision="bf16"),
        ParallelConfig(dp=2, pp=2),
    ):
        with pytest.raises(ConfigError, match="needs torch DDP over whole modules"):
            planned_sfb(plan, parallel, 2)
