"""Cross entropy over vocabulary-sharded logits with uneven shards, without gathering logits.

Shape letters (R ranks in ``group``, this rank r): T tokens; vocabulary V split by widths
v_0..v_{R-1} (any may be 0), rank r owning ids [o_r, o_r + v_r).
    logits_local [T, v_r], targets [T] (global ids, or ``ignore_index``) -> loss [T]

Forward: one all-gather over ``group`` of each rank's [3, T] (its own row max, its sum of exp
below that max, its target logit or 0); every rank combines them (log-sum-exp of the shards).
Three all-reduces (max, then sum of exp, then target logit) cost three latencies.
Backward: no communication: d logits_local = (softmax_local - onehot_local) * d loss.

The loss is sum-reduced over tokens and divided by the number of non-ignored tokens, exactly
what Hugging Face's causal-LM loss computes on full logits. Colossal-AI's DistCrossEntropy
assumes even shards (it derives every rank's range from V / R), so it is wrong here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal_hetero.comm import check_widths, offsets

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits, targets, start, ignore_index, group):  # type: ignore[override]
        ctx.dtype = logits.dtype
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        num_tokens, width = logits.shape
        mine = (targets >= start) & (targets < start + width)
        local_targets = torch.where(mine, targets - start, 0)
        stats = logits.new_zeros(3, num_tokens)  # own max, own sum of exp(l - max), target
        if width:
            stats[0] = logits.amax(-1)
            picked = logits.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1)
            stats[2] = torch.where(mine, picked, 0.0)
        else:
            stats[0] = float("-inf")
        exp = (logits - stats[0].unsqueeze(-1)).exp()
        stats[1] = exp.sum(-1)
        row_max, sum_exp, target_logit = _combine(stats, group)
        exp *= ((stats[0] - row_max).exp() / sum_exp).unsqueeze(-1)  # the softmax, own columns
        valid = targets != ignore_index
        ctx.save_for_backward(exp, mine & valid, local_targets, valid)
        return torch.where(valid, sum_exp.log() - (target_logit - row_max), 0.0)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):  # type: ignore[override]
        softmax, hit, local_targets, valid = ctx.saved_tensors
        grad = softmax.clone()
        rows = hit.nonzero().squeeze(-1)
        grad[rows, local_targets[rows]] -= 1.0
        grad *= (grad_loss * valid).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None


def _combine(
    stats: torch.Tensor, group: ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rank's ``stats`` [3, T] (own row max, own sum of exp below it, own target logit or
    0) -> the global row max, sum of exp below it and target logit, in one all-gather."""
    gathered = [torch.empty_like(stats) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, stats, group=group)
    every = torch.stack(gathered)  # [R, 3, T]
    row_max = every[:, 0].amax(0)
    sum_exp = (every[:, 1] * (every[:, 0] - row_max).exp()).sum(0)
    return row_max, sum_exp, every[:, 2].sum(0)


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor,
    targets: torch.Tensor,
    *,
    widths: Sequence[int],
    group: ProcessGroup,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-token loss [T] (0 where ignored) from logits_local [T, v_r] and global targets [T].

    Computed in at least fp32; the gradient comes back in the logits' dtype.
    """
    widths = check_widths(widths, group)
    rank = dist.get_rank(group)
    if logits_local.dim() != 2 or logits_local.shape[-1] != widths[rank]:
        raise ValueError(f"logits {tuple(logits_local.shape)} do not fit width {widths[rank]}")
    start = offsets(widths)[rank]
    loss = _VocabParallelCrossEntropy.apply(logits_local, targets, start, ignore_index, group)
    return loss


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    widths: Sequence[int],
    group: ProcessGroup,
    gathered: bool = False,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean next-token loss over non-ignored tokens, as transformers' causal-LM loss.

    logits [B, S, v_r] (or [B, S, V] when ``gathered``), labels [B, S] (shifted here).
    """
    width = logits.shape[-1]
    logits = logits[..., :-1, :].reshape(-1 if width else labels[..., 1:].numel(), width)
    targets = labels[..., 1:].reshape(-1).to(logits.device)
    count = (targets != ignore_index).sum().clamp(min=1)
    if gathered:
        total = torch.nn.functional.cross_entropy(
            logits.to(torch.promote_types(logits.dtype, torch.float32)),
            targets,
            ignore_index=ignore_index,
            reduction="sum",
        )
    else:
        per_token = vocab_parallel_cross_entropy(
            logits, targets, widths=widths, group=group, ignore_index=ignore_index
        )
        total = per_token.sum()
    return total / count
