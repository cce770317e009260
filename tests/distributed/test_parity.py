"""Parallel training through HeteroParallelPlugin matches a single-process reference.

One SGD step (lr = LR, no momentum) on the same batch: the gathered parameters after the step
give each rank's gradient as (before - after) / LR, which is compared with the reference
model's gradient, for every parameter the rank holds. With ZeRO the gradients are read from
the optimizer (gathered over the data-parallel group) instead. Losses are compared directly.

Tolerances (tests/tolerances.py): fp32 layouts differ from the reference only in summation
order (TP all-reduces, the data-parallel mean, pipeline microbatch sums), so gradients are
bounded by the reduction chain (depth transformer_depth(layers), sums of at most K_MAX terms)
scaled by the model's largest reference gradient, plus the rounding of reading a gradient
back from the SGD update; the loss by the forward chain scaled by the loss. bf16 (ZeRO) has no
honest elementwise bound (the bf16 chain bound exceeds the gradients themselves), so that
check is structural: loose elementwise bounds catch a missing or doubled shard, cosine > 0.99
a permuted or misrouted one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from colossalai.booster import Booster

from colossal_hetero.config import HeteroConfig, ModelConfig, ParallelConfig
from colossal_hetero.data import shard_batch_by_shares, share_loss_scale
from colossal_hetero.models import build_model, loss_from_outputs
from colossal_hetero.plugin import HeteroParallelPlugin, prepare_device
from colossal_hetero.training.steps import forward_backward
from tests.dist_utils import run_distributed
from tests.tolerances import chain_atol, grad_from_update_atol, transformer_depth

LR = 0.5
K_MAX = 256  # longest sum: the 256-entry vocabulary (hidden <= 128, tokens per batch <= 128)
GPT2 = ModelConfig(
    arch="gpt2",
    hf={
        "n_layer": 4,
        "n_embd": 32,
        "n_head": 4,
        "n_positions": 32,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
)
LLAMA = ModelConfig(
    arch="llama",
    hf={
        "num_hidden_layers": 4,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32,
    },
)


def _batch(batch_size: int = 4, seq_len: int = 16) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 256, (batch_size, seq_len), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _reference(model_cfg: ModelConfig, batch: dict, dtype: torch.dtype):
    model = build_model(model_cfg).to(dtype)
    loss = model(**batch).loss
    loss.backward()
    grads = {name: p.grad.detach().float() for name, p in model.named_parameters()}
    norm = float(torch.stack([g.norm() for g in grads.values()]).norm())
    # The largest weight before or after the SGD step: what reading a gradient back rounds.
    weight_scale = max(
        float(torch.maximum(p.abs(), (p - LR * p.grad).abs()).max()) for p in model.parameters()
    )
    # Tied weights appear once in named_parameters; state_dict names both.
    for name, tensor in model.state_dict().items():
        for other, p in model.named_parameters():
            if tensor.data_ptr() == p.data_ptr() and name not in grads:
                grads[name] = grads[other]
    return float(loss), grads, norm, weight_scale


def _parallel_step(model_cfg: ModelConfig, parallel: ParallelConfig, batch: dict, rank: int):
    plugin = HeteroParallelPlugin(HeteroConfig(parallel=parallel))
    try:
        model = build_model(model_cfg)
        before = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        booster = Booster(plugin=plugin)
        model, optimizer, criterion, _, _ = booster.boost(model, optimizer, loss_from_outputs)
        dp_rank = rank // (parallel.tp * parallel.pp)
        total = len(batch["input_ids"])
        shares = parallel.batch_shares or [total // plugin.dp_size] * plugin.dp_size
        local = shard_batch_by_shares(batch, shares, dp_rank)
        scale = share_loss_scale(shares, dp_rank)
        loss = forward_backward(
            booster,
            model,
            optimizer,
            criterion,
            local,
            use_pipeline=parallel.pp > 1,
            loss_scale=scale,
        )
        if parallel.zero_stage > 0:
            # bf16 working weights would round small updates away: read ZeRO's reduced grads.
            grads = {
                name: optimizer.get_param_grad(p).float()
                for name, p in model.unwrap().named_parameters()
            }
        optimizer.step()
        grad_norm = optimizer.get_grad_norm() if parallel.max_norm > 0 else None
        if parallel.zero_stage == 0:
            after = {k: v.detach().float() for k, v in model.unwrap().state_dict().items()}
            grads = {k: (before[k] - after[k]) / LR for k in after if k in before}
        losses = _gather_losses(loss, plugin)
        weights = [float(shares[r // (parallel.tp * parallel.pp)]) for r in range(len(losses))]
    finally:
        plugin.close()
    return losses, weights, grads, grad_norm


def _gather_losses(loss, plugin) -> list[float]:
    """Every rank's loss (nan where the rank does not compute it), on every rank."""
    value = torch.tensor([float(loss) if loss is not None else float("nan")], dtype=torch.float64)
    gathered = [torch.zeros_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, value)
    return [float(t) for t in gathered]


def _check_layout(rank, model_cfg, parallel, *, bf16: bool = False):
    batch = _batch(sum(parallel.batch_shares) or 4)
    dtype = torch.bfloat16 if bf16 else torch.float32
    ref_loss, ref_grads, ref_norm, weight_scale = _reference(model_cfg, batch, dtype)
    layers = model_cfg.hf.get("n_layer", model_cfg.hf.get("num_hidden_layers"))
    losses, weights, grads, grad_norm = _parallel_step(model_cfg, parallel, batch, rank)
    if grad_norm is not None:  # the norm gradient clipping uses
        # The norm ends the same chain (one more sum, of squares): the gradients' relative
        # chain bound, doubled for that sum and the square root.
        norm_tol = chain_atol(transformer_depth(layers), K_MAX, torch.float32, ref_norm)
        assert abs(grad_norm - ref_norm) <= 2 * norm_tol, (parallel, grad_norm, ref_norm)
    seen = [(x, w) for x, w in zip(losses, weights, strict=True) if x == x]
    assert seen, "no rank computed a loss"
    data_parallel_mean = sum(x * w for x, w in seen) / sum(w for _, w in seen)
    # fp32: the forward chain scaled by the loss (a mean of log-sum-exp minus a logit, each of
    # the loss's size); bf16 (u = 2^-8): structural, as the gradients below.
    loss_tol = (
        2e-2 * max(1.0, abs(ref_loss))
        if bf16
        else chain_atol(transformer_depth(layers, backward=False), K_MAX, dtype, abs(ref_loss))
    )
    assert abs(data_parallel_mean - ref_loss) <= loss_tol, (
        f"{parallel}: loss {data_parallel_mean} vs reference {ref_loss}"
    )
    assert grads, f"rank {rank} holds no parameters"
    grad_scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, grad in grads.items():
        expected = ref_grads[name]
        assert grad.shape == expected.shape, f"{name}: shape {grad.shape} vs {expected.shape}"
        if bf16:
            # Structural (see the module docstring): a missing or doubled shard is off by 50%+.
            torch.testing.assert_close(grad, expected, rtol=5e-2, atol=2e-2, msg=name)
            cosine = torch.nn.functional.cosine_similarity(
                grad.flatten(), expected.flatten(), dim=0
            )
            assert expected.abs().max() == 0 or cosine > 0.99, f"{name}: cosine {cosine}"
        else:
            # Summation order, scaled by the model's largest gradient: a sum that cancels (the
            # key bias's gradient is exactly zero) has terms that large, not its result's size.
            atol = chain_atol(transformer_depth(layers), K_MAX, dtype, grad_scale)
            atol += grad_from_update_atol(LR, dtype, weight_scale)  # read back from the update
            torch.testing.assert_close(grad, expected, rtol=0, atol=atol, msg=name)


def _two_rank_layouts(rank, world_size, device):
    prepare_device(device)
    _check_layout(rank, GPT2, ParallelConfig(tp=2, max_norm=1e6))
    _check_layout(rank, GPT2, ParallelConfig(pp=2, num_microbatches=2))
    _check_layout(rank, LLAMA, ParallelConfig(tp=2))
    _check_layout(rank, GPT2, ParallelConfig(dp=2, zero_stage=1, precision="bf16"), bf16=True)
    _check_layout(rank, LLAMA, ParallelConfig(dp=2, zero_stage=2, precision="bf16"), bf16=True)
    # Uneven data-parallel shares: the weighted gradient must equal the full-batch gradient.
    _check_layout(rank, GPT2, ParallelConfig(dp=2, batch_shares=[3, 1]))


def _four_rank_layouts(rank, world_size, device):
    prepare_device(device)
    _check_layout(rank, GPT2, ParallelConfig(tp=2, pp=2, num_microbatches=2))
    _check_layout(rank, LLAMA, ParallelConfig(tp=2, pp=2, num_microbatches=2))
    _check_layout(rank, GPT2, ParallelConfig(pp=2, dp=2, num_microbatches=2, batch_shares=[6, 2]))


@pytest.mark.numerics
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_tp2_pp2_zero_dp2_match_reference():
    run_distributed(_two_rank_layouts, world_size=2)


@pytest.mark.numerics
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_tp2_x_pp2_matches_reference():
    run_distributed(_four_rank_layouts, world_size=4)
