"""``bench dynamic``, the accuracy run: a ViT on scikit-learn's digits, TP over 4 CPU ranks.

Rank 2 computes 8x slower for the middle half of training (``dynamic_phases.middle_half``).
One world trains, interleaved step by step on the same batches from the same weights:

- ``unperturbed``: ``HeteroParallelPlugin``, even TP, no emulation, no balancer;
- one variant per available balancer mode, under the slowdown.

Trained to convergence: AdamW with a linear warm-up and a cosine decay to 0 at the last step
(``DigitsCase.lr_at``), so that the last quarter (rank 2 back at 1x) settles every variant
into a minimum rather than leaving it wherever a high learning rate last threw it. Each
variant is evaluated on the held-out digits (the data's validation split, never trained on)
every ``eval_every`` steps and at the end. The world is run once per seed (initial weights
and data order); the report averages each mode's paired drop against ``unperturbed`` over
the seeds and gives the spread (``accuracy_report``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Mapping, Sequence
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

DIGITS_KNOBS: dict[str, Any] = {
    **BALANCER_KNOBS,
    "window": 6,
    "smoothing": 0.5,
    "threshold": 1.0,
    "release": 0.5,
}
"""The throughput run's balancer settings, except that a rank is flagged at 2x and released
below 1.5x, from a longer window with more memory: the accuracy run injects one 8x
straggler (flagged at the first agreement all the same: 0.5 x 8 + 0.5 x 1 > 2) and measures
what balancing it costs, which a noise flag elsewhere would inflate. On this small ViT a
ZERO-resized rank's index copies cost more than the GEMM work they save (an earlier idle
run's records: a resized rank measured 1.6-2.4x the others with no slowdown injected), so
at the throughput run's 1.3x a noise flag kept itself flagged until a probe."""

VAL_FRACTION = 0.2
"""Held-out share of the 1797 digits (360 images) the accuracy is measured on."""
EVAL_BATCH = 120
"""Validation batch size: 3 batches hold all 360 held-out images (36 until session 9: each
batch's forward is a round of TP collectives, and ``--quick`` evaluates 8 times per variant
and seed)."""


@dataclass(frozen=True)
class DigitsCase:
    """The accuracy run's sizes and its training recipe."""

    model: ModelConfig
    steps: int
    modes: tuple[str, ...]
    batch_size: int = 256
    eval_every: int = 25
    lr: float = 2e-3
    """AdamW peak learning rate (after the warm-up)."""
    warmup_fraction: float = 0.1
    """Share of the steps over which the learning rate rises linearly to ``lr``."""
    seeds: tuple[int, ...] = (0,)
    """One run of the world per seed: the model's ``init_seed`` and the data order's seed."""
    first_seed_only: tuple[str, ...] = ()
    """Variants (mode or extra variant names) run on the first seed alone; ``unperturbed``
    and the rest run on every seed (each drop stays paired with its own seed's run)."""
    variants: tuple[tuple[str, str, tuple[tuple[str, Any], ...]], ...] = ()
    """Extra variants ``(name, mode, knob overrides)``, run when ``mode`` is in ``modes``
    (e.g. resize with ``freeze_dropped`` off)."""
    slow_rank: int = 2
    factor: float = 8.0
    world: int = 4
    knobs: dict[str, Any] = field(default_factory=lambda: dict(DIGITS_KNOBS))

    @property
    def phases(self) -> tuple[Phase, ...]:
        return tuple(
            middle_half(self.steps, rank=self.slow_rank, factor=self.factor, world=self.world)
        )

    def lr_at(self, step: int) -> float:
        """Learning rate of ``step`` (0-based): ``lr * (step + 1) / W`` for the first ``W``
        steps, then ``lr * (1 + cos(pi * (step - W) / (steps - W))) / 2``, which reaches 0 at
        ``step = steps`` (the last step, ``steps - 1``, is within a rounding of it)."""
        warm = max(1, math.ceil(self.warmup_fraction * self.steps))
        if step < warm:
            return self.lr * (step + 1) / warm
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * (step - warm) / (self.steps - warm)))


QUICK_MODES = ("resize", "semi")
"""The modes ``--quick`` runs on digits: the two the summary's accuracy keys name (migrate and
replan are lossless; the throughput run checks them against an unperturbed run's losses)."""


QUICK_SEEDS = (0, 1)
"""``--quick``'s seeds, fixed up front: one seed's drop spans -0.6 to 2.5 points over seeds
0-7 (docs/balancing-ops.md), so the quick figure is the mean of paired drops. Each further
seed costs ~45 s of the 5 minutes on the idle machine (its unperturbed and resize runs,
140 steps each, the 8x phase of resize slept through): three measured 243 s for this part
under load 6.6, about 180 s idle by the unperturbed steps' ratio: the whole ``--quick``
would have ended about 20 s short of its 5 minutes, an estimate too close to keep."""


def digits_case(quick: bool, modes: tuple[str, ...]) -> DigitsCase:
    """The accuracy run of ``bench dynamic``: ``--quick`` 140 steps (25 epochs of the 1437
    training images at batch 256), ``QUICK_MODES`` only, resize on the ``QUICK_SEEDS``
    and semi on the first (semi bridged with resize on none of the seeds measured so far:
    its drop was 0.00 on each, and a seed of it costs 20 s of the 5 minutes); the full run
    three seeds of 320 steps, every mode, and resize with the dropped columns not frozen as
    an extra variant."""
    if quick:
        kept = tuple(m for m in modes if m in QUICK_MODES)
        return DigitsCase(
            model=vit_model(),
            steps=140,
            modes=kept,
            seeds=QUICK_SEEDS,
            first_seed_only=("semi",),
        )
    unfrozen = ("resize_unfrozen", "resize", (("freeze_dropped", False),))
    return DigitsCase(
        model=vit_model(), steps=320, modes=modes, seeds=(0, 1, 2), variants=(unfrozen,)
    )


def vit_model(hidden: int = 64, heads: int = 8, layers: int = 2) -> ModelConfig:
    """A small ViT for 8x8 digits (2x2 patches), dropout off, 10 classes."""
    return ModelConfig(
        arch="vit",
        hf={
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "intermediate_size": 4 * hidden,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
            # the classifier is replicated on every TP rank (policies/vit.py): no balancer op
            # touches the head, and the ten classes need not divide by the TP width
            "num_labels": 10,
        },
    )


def digits_rank(
    rank: int, world_size: int, device: torch.device, case: DigitsCase
) -> dict[str, Any]:
    """Spawned on every rank: per seed, train every variant interleaved (``run_variants``).

    Returns ``{"runs": [one run_variants result per seed], "seeds", "fixed_fraction",
    "val_images"}``, the same on every rank.
    """
    from colossal_hetero.bench.dynamic_run import fixed_fraction_of
    from colossal_hetero.bench.profile import agree
    from colossal_hetero.data.digits import DigitsData
    from colossal_hetero.plugin import prepare_device
    from colossal_hetero.utils.device import device_kind

    prepare_device(device)
    data = DigitsData(VAL_FRACTION)
    full, fixed = _step_seconds(case.model, data, case.batch_size, device)
    fraction = agree(fixed_fraction_of(full, fixed, world_size), device, "min")
    base = HeteroConfig(
        parallel=ParallelConfig(tp=world_size),
        cluster=ClusterConfig(device=device_kind(device)),
    )
    emulation = emulation_of(case.phases)
    configs = {"unperturbed": base}
    named = [(m, m, ()) for m in case.modes] + [v for v in case.variants if v[1] in case.modes]
    for name, mode, overrides in named:
        knobs = {**case.knobs, **dict(overrides)}
        configs[name] = dataclasses.replace(
            base, emulation=emulation, balancer=balancer_config(mode, knobs, fraction)
        )
    val = data.val_batches(EVAL_BATCH, data.max_val_batches(EVAL_BATCH))
    runs = []
    for index, seed in enumerate(case.seeds):
        chosen = {n: c for n, c in configs.items() if index == 0 or n not in case.first_seed_only}
        world = World(
            model=dataclasses.replace(case.model, init_seed=seed),
            phases=case.phases,
            warmup=0,
            batch_size=case.batch_size,
            seq_len=(8 // 2) ** 2 + 1,  # tokens per image: 2x2 patches of 8x8, plus [CLS]
            train_batch=functools.partial(_train_batch, data, case.batch_size, seed),
            val_batches=val,
            eval_every=case.eval_every,
            lr=case.lr_at(0),
            lr_at=case.lr_at,
        )
        runs.append(run_variants(world, {}, chosen, device))
    return {
        "runs": runs,
        "seeds": list(case.seeds),
        "fixed_fraction": fraction,
        "val_images": data.max_val_batches(EVAL_BATCH) * EVAL_BATCH,
    }


def _train_batch(data: Any, batch_size: int, seed: int, step: int) -> dict[str, torch.Tensor]:
    return data.train_batch(step, batch_size, seed)  # type: ignore[no-any-return]


def accuracy_report(result: Mapping[str, Any], modes: Sequence[str]) -> dict[str, Any]:
    """The accuracy run's figures, from ``digits_rank``'s result.

    Every figure of a variant is over the seeds it ran on (``seeds_of``; the first seed runs
    every variant). ``accuracy``: final held-out accuracy, mean over its seeds;
    ``drop_points``: per mode (and extra variant), the mean of the paired drops
    ``100 * (acc_unperturbed - acc_mode)`` (same seed, same batches, same weights at the
    start); ``drop_by_seed``; ``drop_spread`` (min, max, sample std, and ``ci95``: the
    Student t interval of the mean, ``[mean, mean]`` for one seed); ``val_loss`` and
    ``val_loss_increase`` (relative, mean); ``curves`` (per variant, per seed,
    ``[step, loss, accuracy]``); ``records``: the first seed's decisions.
    """
    runs = result["runs"]
    seeds = list(result.get("seeds", range(len(runs))))
    finals = [{n: v["evals"][-1] for n, v in run["variants"].items()} for run in runs]
    names = list(finals[0])
    ran = [m for m in modes if m in finals[0]] + [
        n for n in names if n != "unperturbed" and n not in modes
    ]
    seeds_of = {n: [s for s, f in zip(seeds, finals, strict=True) if n in f] for n in names}
    drops = {m: [100.0 * (f["unperturbed"][2] - f[m][2]) for f in finals if m in f] for m in ran}
    increases = {
        m: [(f[m][1] - f["unperturbed"][1]) / f["unperturbed"][1] for f in finals if m in f]
        for m in ran
    }
    return {
        "seeds": seeds,
        "seeds_of": seeds_of,
        "val_images": result.get("val_images"),
        "accuracy": {n: statistics.fmean([f[n][2] for f in finals if n in f]) for n in names},
        "drop_points": {m: statistics.fmean(d) for m, d in drops.items()},
        "drop_by_seed": drops,
        "drop_spread": {m: _spread(d) for m, d in drops.items()},
        "val_loss": {n: statistics.fmean([f[n][1] for f in finals if n in f]) for n in names},
        "val_loss_increase": {m: statistics.fmean(v) for m, v in increases.items()},
        "curves": {
            n: [run["variants"][n]["evals"] for run in runs if n in run["variants"]] for n in names
        },
        "records": {m: runs[0]["variants"][m]["records"] for m in ran},
        "step_time_median": {
            n: statistics.median(
                max(row[0::4])
                for run in runs
                if n in run["variants"]
                for row in run["variants"][n]["rows"]
            )
            for n in names
        },
    }


def _spread(drops: Sequence[float]) -> dict[str, Any]:
    """min, max, sample std and the two-sided 95% Student t interval of the mean of
    ``drops`` (the seeds' paired drops: independent draws of one run's drop)."""
    from scipy.stats import t as student_t

    mean = statistics.fmean(drops)
    std = statistics.stdev(drops) if len(drops) > 1 else 0.0
    half = 0.0
    if len(drops) > 1:
        half = float(student_t.ppf(0.975, len(drops) - 1)) * std / math.sqrt(len(drops))
    return {"min": min(drops), "max": max(drops), "std": std, "ci95": [mean - half, mean + half]}


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
