"""Optimizer and learning-rate schedule from the config."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from colossal_hetero.config.schema import OptimizerConfig


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW or SGD over all trainable parameters of ``model``."""
    params = [p for p in model.parameters() if p.requires_grad]
    if config.name == "sgd":
        return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to 1, then cosine decay to 0.1 at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimizerConfig, total_steps: int
) -> LambdaLR:
    """Warm-up and cosine schedule, stepped once per optimizer step."""
    return LambdaLR(optimizer, lambda step: lr_factor(step, config.warmup_steps, total_steps))
