"""One training step and one validation pass through a boosted model, for any layout.

With pipeline parallelism only the last stage sees the loss; other ranks return ``None``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from colossalai.booster import Booster

Batch = dict[str, torch.Tensor]


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Move every tensor of ``batch`` to ``device``."""
    return {key: value.to(device) for key, value in batch.items()}


def forward_backward(
    booster: Booster,
    model: Any,
    optimizer: Any,
    criterion: Callable,
    batch: Batch,
    *,
    use_pipeline: bool,
    loss_scale: float = 1.0,
) -> float | None:
    """Forward and backward on this rank's share of a global batch (gradients accumulate).

    The loss is multiplied by ``loss_scale`` before backward (uneven data-parallel shares: see
    ``data.share_loss_scale``). Returns this rank's unscaled mean loss where it computes one,
    else ``None``.
    """
    scaled = criterion if loss_scale == 1.0 else _scaled(criterion, loss_scale)
    if use_pipeline:
        result = booster.execute_pipeline(iter([batch]), model, scaled, optimizer, return_loss=True)
        loss = result["loss"]
    else:
        loss = scaled(model(**batch), batch)
        booster.backward(loss, optimizer)
    return None if loss is None else float(loss.detach().float()) / loss_scale


def train_step(
    booster: Booster,
    model: Any,
    optimizer: Any,
    criterion: Callable,
    batch: Batch,
    *,
    use_pipeline: bool,
    loss_scale: float = 1.0,
) -> float | None:
    """``forward_backward``, then the optimizer step; returns the same loss."""
    loss = forward_backward(
        booster,
        model,
        optimizer,
        criterion,
        batch,
        use_pipeline=use_pipeline,
        loss_scale=loss_scale,
    )
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _scaled(criterion: Callable, factor: float) -> Callable:
    def scaled(outputs: Any, inputs: Any) -> torch.Tensor:
        return criterion(outputs, inputs) * factor

    return scaled


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Validation result, identical on every rank."""

    loss: float
    accuracy: float | None
    """Top-1 accuracy for classifiers; None for language models."""


def evaluate(
    booster: Booster,
    model: Any,
    criterion: Callable,
    batches: list[Batch],
    *,
    use_pipeline: bool,
    device: torch.device,
) -> Evaluation:
    """Sample-weighted mean validation loss (and accuracy for classifiers), on every rank.

    Collectives: one all_reduce of 4 numbers over the world group.
    """
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, count, correct, n
    with torch.no_grad():
        for batch in batches:
            loss, logits = _forward_loss(booster, model, criterion, batch, use_pipeline)
            if loss is None:
                continue
            num_samples = len(next(iter(batch.values())))
            totals[0] += float(loss) * num_samples  # ranks may hold uneven shares
            totals[1] += num_samples
            if logits is not None and logits.dim() == 2:
                labels = batch["labels"]
                totals[2] += float((logits.argmax(dim=-1) == labels).sum())
                totals[3] += labels.numel()
    model.train()
    dist.all_reduce(totals)
    loss = float(totals[0] / totals[1])
    accuracy = float(totals[2] / totals[3]) if totals[3] > 0 else None
    return Evaluation(loss=loss, accuracy=accuracy)


def _forward_loss(
    booster: Booster, model: Any, criterion: Callable, batch: Batch, use_pipeline: bool
) -> tuple[float | None, torch.Tensor | None]:
    if use_pipeline:
        result = booster.plugin.forward_pipeline(
            iter([batch]), model, criterion, return_outputs=True
        )
        loss, outputs = result["loss"], result.get("outputs")
        logits = getattr(outputs, "logits", None) if outputs is not None else None
        if isinstance(outputs, dict):
            logits = outputs.get("logits")
        return (None if loss is None else float(loss)), logits
    outputs = model(**batch)
    return float(criterion(outputs, batch)), getattr(outputs, "logits", None)
