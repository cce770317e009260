"""``colossal-hetero bench dynamic [--quick] [--json PATH]``: runtime straggler balancing.

Throughput run (per model: GPT-2, Llama): TP=4 on 4 CPU ranks under a three-phase schedule
(rank 1 at 1x, 4x, 1x; rank 3 at 2x throughout; ``dynamic_phases``). One spawned world
trains, interleaved step by step, stock Colossal-AI (unperturbed and slowed), our even TP
with each balancer mode that this build can run, and the oracle (the static planner given
each phase's true speeds). Per phase: median step time, ideal bound, efficiency, speedup,
slowdown removed, detection delay, bytes per step, validation loss.

Accuracy run: a ViT on scikit-learn's digits, TP=4, rank 2 at 8x for the middle half of
training, each mode's held-out accuracy against the unperturbed run (``dynamic_digits``).

A mode the build cannot run (its config is refused) is listed with the refusal, and the
summary keys that need it are null with that reason.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from colossal_hetero.bench.dynamic_digits import (
    DigitsCase,
    accuracy_report,
    digits_case,
    digits_rank,
)
from colossal_hetero.bench.dynamic_phases import (
    summarise,
    summarise_case,
    three_phases,
)
from colossal_hetero.bench.dynamic_run import ThroughputCase, throughput_rank
from colossal_hetero.config.schema import ModelConfig

CANDIDATE_MODES = ("replan", "resize", "migrate", "semi")
"""Balancer modes the benchmark runs when the build accepts them (``none`` always runs)."""


def available_modes(tp: int = 4) -> tuple[tuple[str, ...], dict[str, str]]:
    """(modes this build runs, {mode: why not}) from the config checks themselves: a mode
    whose balancer section or layout check raises is unavailable, with that message."""
    from colossal_hetero.balance.checks import check_balancer
    from colossal_hetero.config.balancer import BalancerConfig
    from colossal_hetero.config.schema import HeteroConfig, ParallelConfig

    ok, refused = [], {}
    for mode in CANDIDATE_MODES:
        try:
            config = HeteroConfig(
                parallel=ParallelConfig(tp=tp),
                balancer=BalancerConfig(mode=mode),  # type: ignore[arg-type]
            )
            check_balancer(config)
        except ValueError as error:  # ConfigError is a ValueError
            refused[mode] = str(error)
        else:
            ok.append(mode)
    return tuple(ok), refused


def _gpt2(width: int, heads: int, seq_len: int, layers: int) -> ModelConfig:
    return ModelConfig(
        arch="gpt2",
        hf={
            "n_layer": layers,
            "n_embd": width,
            "n_head": heads,
            "n_positions": seq_len,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    )


def _llama(width: int, heads: int, seq_len: int, layers: int) -> ModelConfig:
    # Llama's own MLP width, 8/3 of the hidden size rounded up to a multiple of 32: its three
    # matrices then hold as many weights as GPT-2's two at 4x, so both models' steps weigh alike.
    ffn = -(-8 * width // 3 // 32) * 32
    return ModelConfig(
        arch="llama",
        hf={
            "num_hidden_layers": layers,
            "hidden_size": width,
            "intermediate_size": ffn,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "max_position_embeddings": seq_len,
        },
    )


QUICK_LLAMA_MODES = ("semi",)
"""Balancer modes ``--quick`` runs on Llama (GPT-2 runs every mode): the summary's semi
figures cover both models, the exactness of migrate and replan is checked on GPT-2, and
the run stays within its 5 minutes."""


def cases(quick: bool, modes: tuple[str, ...]) -> tuple[list[ThroughputCase], DigitsCase]:
    """The throughput cases and the accuracy run's sizes.

    Sized so that tensor-parallel compute is the large part of a step, as on GPUs: on 4 CPU
    ranks over gloo every collective costs milliseconds of latency whatever its size, so a
    small model (width 256, two layers: compute 0.41 of the step at the end of session 4) hides
    a straggler behind communication that no balancer can remove. Widths 384 (``--quick``, one
    layer, for its 5 minutes) and 512 (two layers) at 8 x 64 tokens give each collective 2.25x
    and 4x the matrix work. The measured fraction is in the JSON (``compute_fraction``).
    """
    per_phase, warmup, seq = (10, 2, 64) if quick else (30, 3, 64)
    width, layers = (384, 1) if quick else (512, 2)
    phases = tuple(three_phases(per_phase, warmup=warmup))
    llama_modes = tuple(m for m in modes if m in QUICK_LLAMA_MODES) if quick else modes
    throughput = [
        ThroughputCase(name, build(width, 8, seq, layers), phases, kept, warmup=warmup, seq_len=seq)
        for name, build, kept in (("gpt2", _gpt2, modes), ("llama", _llama, llama_modes))
    ]
    digits = digits_case(quick, modes)
    return throughput, digits


def bench_rank(
    rank: int,
    world_size: int,
    device: torch.device,
    throughput: list[ThroughputCase],
    digits: DigitsCase | None,
) -> dict[str, Any]:
    """Spawned on every rank: every throughput case, then the accuracy run, in one world
    (one start-up); each part closes its plugins before the next begins."""
    out: dict[str, Any] = {"throughput": [], "digits": None, "seconds": {}}
    for case in throughput:
        started = time.perf_counter()
        out["throughput"].append(throughput_rank(rank, world_size, device, case))
        out["seconds"][case.name] = time.perf_counter() - started
    if digits is not None:
        started = time.perf_counter()
        out["digits"] = digits_rank(rank, world_size, device, digits)
        out["seconds"]["digits"] = time.perf_counter() - started
    return out


PARTS = ("gpt2", "llama", "digits")
"""The benchmark's parts: two throughput models and the accuracy run."""


def select(only: str, modes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(parts, modes) kept by ``--only``: comma-separated parts (gpt2, llama, digits) and
    balancer modes (replan, resize, migrate, semi); a kind left unnamed keeps all of it."""
    tokens = [t.strip() for t in only.split(",") if t.strip()]
    unknown = [t for t in tokens if t not in PARTS and t not in CANDIDATE_MODES]
    if unknown:
        raise ValueError(
            f"bench dynamic: --only {only!r}: unknown {unknown}; parts {list(PARTS)}, modes "
            f"{list(CANDIDATE_MODES)}"
        )
    parts = tuple(t for t in PARTS if t in tokens) or PARTS
    named = [t for t in tokens if t in CANDIDATE_MODES]
    return parts, tuple(m for m in modes if not named or m in named)


def run_dynamic_benchmark(*, quick: bool, json_path: str = "", only: str = "") -> int:
    """Run the benchmark, print its tables, write the JSON (``json_path``) and return 0.

    ``only``: see :func:`select`; modes the build refuses are never run.
    """
    from rich.console import Console

    from colossal_hetero.bench.dynamic_report import print_report
    from colossal_hetero.bench.spawn import spawn_ranks

    console = Console(width=160)  # ten columns per table
    started = time.perf_counter()
    available, refused = available_modes()
    parts, modes = select(only, available)
    skipped = {m: "left out by --only" for m in available if m not in modes}
    throughput, digits_case = cases(quick, modes)
    throughput = [c for c in throughput if c.name in parts]
    digits = digits_case if "digits" in parts else None
    not_run = sorted({**refused, **skipped})
    console.print(
        f"[bold]bench dynamic[/]: TP=4 on 4 CPU ranks; parts {list(parts)}; modes "
        f"{['none', *modes]}" + (f"; not run: {not_run}" if not_run else "")
    )
    result = spawn_ranks(bench_rank, 4, throughput=throughput, digits=digits)[0]
    rows = [
        summarise_case(c.name, r, c.phases, warmup=c.warmup, modes=("none", *c.modes))
        for c, r in zip(throughput, result["throughput"], strict=True)
    ]
    accuracy = accuracy_report(result["digits"], modes) if result["digits"] else None
    report: dict[str, Any] = {
        "benchmark": "dynamic",
        "quick": quick,
        "only": only,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "load_average_1min": round(os.getloadavg()[0], 1),  # other work on the host, at the end
        "modes": ["none", *modes],
        "summary": summarise(rows, accuracy, {**refused, **skipped}),
        "throughput": rows,
        "accuracy": accuracy,
        "raw": result,
        "seconds": result["seconds"],
    }
    report["wall_time_s"] = time.perf_counter() - started
    print_report(console, report)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
        console.print(f"wrote {json_path}")
    return 0
