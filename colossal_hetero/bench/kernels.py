"""``bench kernels``: this device's GEMM time against a TP shard's width, and ZERO-resizing's cut.

One process, on the device this host trains on (the GPU when torch sees one, else the CPU).
Both parts interleave their variants in rounds (``bench.rounds``); every variant times
forward + backward of one linear layer, ``reps`` calls between two device synchronisations.

- **widths**: a column-parallel shard, x [T, H] @ W[w, H]^T, for widths w from H/8 to H. The
  planner prices a shard as affine in its width (a fixed cost plus a per-column rate); the
  figures are each width's time over the even shard's (H/4, stock TP=4), the affine fit's
  worst relative error, and the time of widths that are off the 64-column tile against the
  width rounded up to it (> 1: the ragged width costs more than a wider aligned one).
- **resize**: ZERO-resizing's kept-subset linear (``balance.ops.resized_linear``: gather the
  kept reduction columns, smaller GEMMs, scatter the gradients) at kept fractions 3/4, 1/2,
  1/4 against the full linear (stock: every column computed); reported as the time saved over
  the ideal saving (1 - f), 1.0 meaning the cut saves all it could.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from colossal_hetero.bench.rounds import Figure, RoundsPolicy, Variant, run_rounds
from colossal_hetero.utils.device import (
    device_name,
    is_host_device,
    local_device,
    synchronize,
)

TILE = 64
"""Column tile the ragged-width check rounds up to (tensor-core GEMMs tile N by 64 or more)."""

KEPT_FRACTIONS = (0.75, 0.5, 0.25)


@dataclass(frozen=True)
class KernelCase:
    """Sizes of one run: ``tokens`` rows, ``hidden`` reduction width, in ``dtype``."""

    tokens: int
    hidden: int
    dtype: torch.dtype
    reps: int
    budget_s: float


def _case(device: torch.device, quick: bool) -> KernelCase:
    if is_host_device(device):  # a smoke-sized run: CPU GEMMs at these widths take milliseconds
        return KernelCase(512, 512, torch.float32, 3, 20.0 if quick else 60.0)
    return KernelCase(8192, 4096, torch.bfloat16, 20, 30.0 if quick else 90.0)


def _timed(step: Callable[[], None], device: torch.device, reps: int) -> Variant:
    """A variant that runs ``step`` ``reps`` times and returns seconds per call."""

    def variant(index: int, *, warmup: bool) -> float:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(reps):
            step()
        synchronize(device)
        return (time.perf_counter() - start) / reps

    return variant


def _linear_step(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        weight.grad = None
        x.grad = None
        torch.nn.functional.linear(x, weight).backward(dy)

    return step


def _widths(case: KernelCase) -> list[int]:
    h = case.hidden
    aligned = [h * i // 8 for i in range(1, 9)]
    # off the tile, each with the aligned width just below and the one it rounds up to
    ragged = [h // 4 + 8, h // 4 + TILE, h // 2 + 8, h // 2 + 40, h // 2 + TILE]
    return sorted(set(aligned + ragged))


def _width_variants(case: KernelCase, device: torch.device) -> dict[str, Variant]:
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(case.tokens, case.hidden, generator=gen, device=device, dtype=case.dtype)
    x.requires_grad_()
    variants: dict[str, Variant] = {}
    for width in _widths(case):
        w = torch.randn(width, case.hidden, generator=gen, device=device, dtype=case.dtype)
        dy = torch.randn(case.tokens, width, generator=gen, device=device, dtype=case.dtype)
        variants[f"w{width}"] = _timed(_linear_step(x, w.requires_grad_(), dy), device, case.reps)
    return variants


def _resize_variants(case: KernelCase, device: torch.device) -> dict[str, Variant]:
    from colossal_hetero.balance.ops import resized_linear

    gen = torch.Generator(device=device).manual_seed(1)
    h, out = case.hidden, case.hidden // 4  # a row of a TP=4 column-parallel shard
    x = torch.randn(case.tokens, h, generator=gen, device=device, dtype=case.dtype)
    w = torch.randn(out, h, generator=gen, device=device, dtype=case.dtype)
    dy = torch.randn(case.tokens, out, generator=gen, device=device, dtype=case.dtype)
    x.requires_grad_()
    w.requires_grad_()
    variants = {"full": _timed(_linear_step(x, w, dy), device, case.reps)}
    for fraction in KEPT_FRACTIONS:
        kept = torch.randperm(h, generator=gen, device=device)[: int(h * fraction)].sort().values

        def step(kept: torch.Tensor = kept) -> None:
            w.grad = None
            x.grad = None
            resized_linear(x, w, None, kept).backward(dy)

        variants[f"kept{fraction}"] = _timed(step, device, case.reps)
    return variants


def _ratio(numerator: str, denominator: str) -> Figure:
    """The figure ``numerator / denominator`` of one round's series."""

    def figure(values: Mapping[str, float]) -> float:
        return values[numerator] / values[denominator]

    return figure


def _affine_fit(widths: list[int], times: list[float]) -> tuple[float, float, float]:
    """Least-squares t = a + b w over the aligned widths; returns a, b and the worst relative
    error of the fit."""
    w, t = np.asarray(widths, dtype=float), np.asarray(times, dtype=float)
    b, a = np.polyfit(w, t, 1)
    worst = float(np.max(np.abs(a + b * w - t) / t))
    return float(a), float(b), worst


def _width_report(case: KernelCase, device: torch.device, policy: RoundsPolicy) -> dict[str, Any]:
    widths = _widths(case)
    even = case.hidden // 4
    figures = {f"w{w}_over_even": _ratio(f"w{w}", f"w{even}") for w in widths}
    for w in widths:
        if w % TILE:
            up = -(-w // TILE) * TILE
            if up in widths:
                figures[f"ragged_w{w}_over_w{up}"] = _ratio(f"w{w}", f"w{up}")
    result = run_rounds(_width_variants(case, device), figures, policy)
    median = {w: result.medians[f"w{w}"].value for w in widths}
    aligned = [w for w in widths if w % TILE == 0]
    a, b, worst = _affine_fit(aligned, [median[w] for w in aligned])
    ragged = [v.value for k, v in result.figures.items() if k.startswith("ragged")]
    return {
        "rounds": result.to_dict(),
        "seconds": median,
        "ragged_over_aligned_max": max(ragged, default=1.0),
        "affine_fixed_s": a,
        "affine_per_column_s": b,
        "affine_max_rel_error": worst,
    }


def _resize_report(case: KernelCase, device: torch.device, policy: RoundsPolicy) -> dict[str, Any]:
    figures = {f"kept{f}_speedup": _ratio("full", f"kept{f}") for f in KEPT_FRACTIONS}
    result = run_rounds(_resize_variants(case, device), figures, policy)
    full = result.medians["full"].value
    saving = {
        str(f): (1.0 - result.medians[f"kept{f}"].value / full) / (1.0 - f) for f in KEPT_FRACTIONS
    }
    return {"rounds": result.to_dict(), "saving_over_ideal": saving}


def run_kernels_benchmark(*, quick: bool, json_path: str = "") -> int:
    """Run both parts on this host's device; print a summary; write JSON to ``json_path``."""
    device = local_device(0, 1)
    case = _case(device, quick)
    policy = RoundsPolicy(warmup=2, min_rounds=10, max_rounds=60, budget_s=case.budget_s)
    widths = _width_report(case, device, policy)
    resize = _resize_report(case, device, policy)
    summary = {
        "device": device_name(device),
        "dtype": str(case.dtype).removeprefix("torch."),
        "tokens": case.tokens,
        "hidden": case.hidden,
        "affine_max_rel_error": widths["affine_max_rel_error"],
        "ragged_over_aligned_max": widths["ragged_over_aligned_max"],
        "resize_saving_over_ideal": resize["saving_over_ideal"],
    }
    print(json.dumps(summary, indent=1))
    if json_path:
        with open(json_path, "w") as out:
            json.dump({"summary": summary, "widths": widths, "resize": resize}, out, indent=1)
    return 0
