"""``bench dynamic``, the accuracy run: a ViT on scikit-learn's digits, TP over 4 CPU ranks.

Rank 2 computes 8x slower for the middle half of training (``dynamic_phases.middle_half``).
One world trains, interleaved step by step on the same batches from the same weights:

- ``unperturbed``: ``HeteroParallelPlugin``, even TP, no emulation, no balancer;
- one variant per available balancer mode, under the slowdown.

Each is evaluated on the held-out digits (the data's validation split, never trained on)
every ``eval_every`` steps and at the end; the report compares the final accuracies.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from colossal_hetero.bench.dynamic_phases import Phase, middle_half
from colossal_hetero.bench.dynamic_run import BALANCER_KNOBS, balancer_config, emulation_of
from colossal_hetero.bench.dynamic_variants import World, run_variants
from colossal_hetero.config.schema import (
    ClusterConfig,
    HeteroConfig,
    ModelConfig,
    ParallelConfig,
)

VAL_FRACTION = 0.2
"""Held-out share of the 1797 digits (360 images) the accuracy is measured on."""
EVAL_BATCH = 36
"""Validation batch size: 10 batches hold all 360 held-out images."""


@dataclass(frozen=True)
class DigitsCase:
    """The accuracy run's sizes."""

    model: ModelConfig
    steps: int
    modes: tuple[str, ...]
    batch_size: int = 64
    eval_every: int = 25
    lr: float = 3e-3
    """AdamW learning rate (the digits example config's)."""
    slow_rank: int = 2
    factor: float = 8.0
    world: int = 4
    knobs: dict[str, Any] = field(default_factory=lambda: dict(BALANCER_KNOBS))

    @property
    def phases(self) -> tuple[Phase, ...]:
        return tuple(
            middle_half(self.steps, rank=self.slow_rank, factor=self.factor, world=self.world)
        )


def vit_model(hidden: int = 64, heads: int = 8, layers: int = 2) -> ModelConfig:
    """A small ViT for 8x8 digits (2x2 patches), dropout off, 12 outputs (10 used)."""
    return ModelConfig(
        arch="vit",
        hf={
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "intermediate_size": 4 * hidden,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
            # The stock ViT policy splits the classifier over the TP ranks, so its outputs
            # must divide by 4: two extra classes that no label ever names.
            "num_labels": 12,
        },
    )


def digits_rank(
    rank: int, world_size: int, device: torch.device, case: DigitsCase
) -> dict[str, Any]:
    """Spawned on every rank: train every variant interleaved; see ``run_variants``."""
    from colossal_hetero.bench.dynamic_run import fixed_fraction_of
    from colossal_hetero.bench.profile import agree
    from colossal_hetero.data.digits import DigitsData
    from colossal_hetero.plugin import prepare_device

    prepare_device(device)
    data = DigitsData(VAL_FRACTION)
    full, fixed = _step_seconds(case.model, data, case.batch_size, device)
    fraction = agree(fixed_fraction_of(full, fixed, world_size), device, "min")
    from colossal_hetero.utils.device import device_kind

    kind = device_kind(device)
    base = HeteroConfig(
        parallel=ParallelConfig(tp=world_size),
        cluster=ClusterConfig(device=kind),
    )
    emulation = emulation_of(case.phases)
    configs = {"unperturbed": base}
    for mode in case.modes:
        configs[mode] = dataclasses.replace(
            base, emulation=emulation, balancer=balancer_config(mode, case.knobs, fraction)
        )
    world = World(
        model=case.model,
        phases=case.phases,
        warmup=0,
        batch_size=case.batch_size,
        seq_len=(8 // 2) ** 2 + 1,  # tokens per image: 2x2 patches of 8x8, plus [CLS]
        train_batch=lambda step: data.train_batch(step, case.batch_size, 0),
        val_batches=data.val_batches(EVAL_BATCH, data.max_val_batches(EVAL_BATCH)),
        eval_every=case.eval_every,
        lr=case.lr,
    )
    result = run_variants(world, {}, configs, device)
    result["fixed_fraction"] = fraction
    result["val_images"] = data.max_val_batches(EVAL_BATCH) * EVAL_BATCH
    return result


def _step_seconds(
    model_cfg: ModelConfig, data: Any, batch_size: int, device: torch.device
) -> tuple[float, float]:
    """Single-process training-step seconds of the model and of the same model at one feature
    per head (its fixed cost), on one digits batch; no collectives."""
    from colossal_hetero.models import build_hf_config, build_model
    from colossal_hetero.utils.device import synchronize

    heads = build_hf_config(model_cfg).num_attention_heads
    tiny = dataclasses.replace(
        model_cfg, hf={**model_cfg.hf, "hidden_size": heads, "intermediate_size": 4 * heads}
    )
    batch = {k: v.to(device) for k, v in data.train_batch(0, batch_size, 0).items()}
    out = []
    for cfg in (model_cfg, tiny):
        model = build_model(cfg).to(device)
        times = []
        for _ in range(6):
            synchronize(device)
            start = time.perf_counter()
            model(**batch).loss.backward()
            synchronize(device)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times[1:]))
    return out[0], out[1]
