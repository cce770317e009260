"""1D or 2D tensor parallelism for a run: the comparison ``plan`` prints, the pick of
``parallel.tp_mode: auto`` (pure; no torch.distributed).

Per rank and step, for each mode (1D, 1D with sequence parallelism for reference, 2D):

- memory = layers x (parameters x element bytes x ``state_copies``) + activation bytes
  (``tp2d_memory.gpt2_activation_bytes``: what this project's GPT-2 keeps, measured within
  0.1% by ``bench tp2d``); ``state_copies`` 4 = weights, gradients and AdamW's two moments;
- communication = layers x (bandwidth words x element bytes / link bandwidth + collective
  calls x latency), from ``tp2d_cost`` (1D: four all-reduces of the activations per layer;
  2D: SUMMA broadcasts and reduces of activation and weight blocks).

The pick: 1D when tp is 1 or not a square, or the model is not GPT-2 (2D supports GPT-2
only); else, among 1D and 2D, those whose memory fits the smallest device; of those the one
with less communication time; when neither fits, the one needing less memory. Compute is the
same in both (the same GEMMs split P ways) and is left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from colossal_hetero.planner.tp2d_cost import LayerDims, Shares2D, cost_1d, cost_2d
from colossal_hetero.planner.tp2d_memory import gpt2_activation_bytes
from colossal_hetero.planner.tp2d_plan import Tp2dPlan, plan_tp2d


@dataclass(frozen=True)
class ModeEstimate:
    """One mode's per-rank figures for the whole model (all layers), one step."""

    mode: str
    params: int
    activation_bytes: float
    memory_bytes: float
    comm_bytes: float
    calls: int
    comm_seconds: float
    fits: bool


@dataclass(frozen=True)
class ModeChoice:
    """The chosen ``tp_mode`` (``1d`` or ``2d``), why, and every mode's estimate."""

    mode: str
    reason: str
    estimates: dict[str, ModeEstimate]
    resizable: Tp2dPlan | None = None
    """``plan.tp2d`` as the plugin applies it under ``tp_mode: 2d`` (``tp2d_plan.plan_tp2d``
    over every TP group), when the devices differ."""


def estimate_modes(
    dims: LayerDims,
    tp: int,
    layers: int,
    vocab: int,
    *,
    bandwidth_bytes_s: float,
    latency_s: float,
    memory_bytes: float,
    state_copies: int = 4,
) -> dict[str, ModeEstimate]:
    """Estimates of ``1d`` and ``1d-sp`` (and ``2d`` when tp is a square and the even 2D
    layout divides the sizes) for ``layers`` layers of ``dims``."""
    costs = {"1d": cost_1d(dims, tp), "1d-sp": cost_1d(dims, tp, sequence_parallel=True)}
    q = math.isqrt(tp)
    if tp > 1 and q * q == tp:
        try:
            costs["2d"] = cost_2d(dims, Shares2D.even(dims, q))
        except ValueError:
            pass  # the even layout does not divide the batch, heads or MLP: no 2D estimate
    out = {}
    for mode, cost in costs.items():
        try:
            act = gpt2_activation_bytes(
                mode,  # type: ignore[arg-type]
                layers=layers,
                batch=dims.batch,
                seq=dims.seq,
                hidden=dims.hidden,
                heads=dims.heads,
                vocab=vocab,
                tp=tp,
                ffn=dims.ffn,
                elem_bytes=dims.elem_bytes,
            )
        except ValueError:
            continue  # 2D with a vocabulary the even layout cannot split
        memory = layers * cost.params * dims.elem_bytes * state_copies + act
        comm = layers * cost.comm_bytes(dims.elem_bytes)
        calls = layers * sum(c for c, _ in cost.comm.calls.values())
        out[mode] = ModeEstimate(
            mode=mode,
            params=layers * cost.params,
            activation_bytes=act,
            memory_bytes=memory,
            comm_bytes=comm,
            calls=calls,
            comm_seconds=comm / bandwidth_bytes_s + calls * latency_s,
            fits=memory <= memory_bytes,
        )
    return out


def choose_tp_mode(
    estimates: dict[str, ModeEstimate], tp: int, *, supports_2d: bool = True
) -> ModeChoice:
    """The pick described in the module docstring."""
    q = math.isqrt(tp)
    if tp == 1 or q * q != tp:
        return ModeChoice("1d", f"tp {tp} is not a square > 1", estimates)
    if not supports_2d:
        return ModeChoice("1d", "2D supports GPT-2 only", estimates)
    if "2d" not in estimates:
        return ModeChoice("1d", "the even 2D layout does not divide the sizes", estimates)
    one, two = estimates["1d"], estimates["2d"]
    if one.fits and two.fits:
        if two.comm_seconds < one.comm_seconds:
            return ModeChoice("2d", "both fit; 2D communicates less", estimates)
        return ModeChoice("1d", "both fit; 1D communicates less", estimates)
    if one.fits or two.fits:
        mode = "1d" if one.fits else "2d"
        return ModeChoice(mode, f"only {mode.upper()} fits the smallest device", estimates)
    mode = "2d" if two.memory_bytes < one.memory_bytes else "1d"
    return ModeChoice(mode, f"neither fits; {mode.upper()} needs less memory", estimates)


def format_choice(choice: ModeChoice, configured: str) -> str:
    """The comparison table ``plan`` prints, per rank and step, and the pick."""
    lines = [
        "",
        "1D vs 2D tensor parallelism (per rank, one step; params of the transformer layers;"
        " planner/tp2d_choice.py):",
        f"  {'mode':<6} {'params':>10} {'activations':>12} {'memory':>10} "
        f"{'traffic':>10} {'calls':>6} {'comm':>10}  fits",
    ]
    mib = 2**20
    for e in choice.estimates.values():
        lines.append(
            f"  {e.mode:<6} {e.params:>10,} {e.activation_bytes / mib:>9.1f} MiB "
            f"{e.memory_bytes / mib:>6.0f} MiB {e.comm_bytes / mib:>6.1f} MiB {e.calls:>6} "
            f"{e.comm_seconds * 1e3:>7.2f} ms  {'yes' if e.fits else 'no'}"
        )
    if choice.resizable is not None:
        lines.append(choice.resizable.summary())
    if configured == "auto":
        lines.append(f"tp_mode auto: {choice.mode} ({choice.reason})")
    else:
        lines.append(f"tp_mode {configured} (auto would pick {choice.mode}: {choice.reason})")
    return "\n".join(lines)


def choose_for_config(config: object, world_size: int) -> ModeChoice:
    """``choose_tp_mode`` for a run config (``RunConfig``): one pipeline stage's layers, the
    micro-batch of one data-parallel group, the smallest device's memory and link."""
    from colossal_hetero.models import build_hf_config

    model, data = config.model, config.data  # type: ignore[attr-defined]
    parallel, cluster, plan = config.parallel, config.cluster, config.plan  # type: ignore[attr-defined]
    tp = parallel.tp
    if model.arch != "gpt2":
        return choose_tp_mode({}, tp, supports_2d=False)
    hf = build_hf_config(model)
    dp = max(world_size // (tp * parallel.pp), 1)
    micro = max(data.global_batch_size // dp // max(parallel.num_microbatches, 1), 1)
    dims = LayerDims(
        batch=micro,
        seq=data.seq_len,
        hidden=hf.n_embd,
        heads=hf.n_head,
        ffn=hf.n_inner or 4 * hf.n_embd,
        elem_bytes=4 if parallel.precision == "fp32" else 2,
        dropout=False,
    )
    devices = cluster.devices
    memory_gib = min((d.memory_gib for d in devices), default=16.0)
    gbps = min((d.bandwidth_gbps for d in devices), default=100.0)
    estimates = estimate_modes(
        dims,
        tp,
        max(hf.n_layer // parallel.pp, 1),
        hf.vocab_size,
        bandwidth_bytes_s=gbps * 1e9 / 8,
        latency_s=plan.latency_us * 1e-6,
        memory_bytes=memory_gib * 2**30,
    )
    choice = choose_tp_mode(estimates, tp)
    speeds = [d.speed for d in devices]
    if len(speeds) == world_size and len(set(speeds)) > 1 and "2d" in estimates:
        # Colossal-AI's process-group mesh with pp 1: TP groups are consecutive ranks.
        groups = [range(g * tp, (g + 1) * tp) for g in range(world_size // tp)]
        batch = data.global_batch_size // dp  # what the plugin plans for (one DP batch)
        resized = plan_tp2d(speeds, groups, batch, dims.heads, dims.ffn, hf.vocab_size)
        choice = replace(choice, resizable=resized)
    return choice


def resolved_tp_mode(config: object, world_size: int) -> str:
    """``parallel.tp_mode`` with ``auto`` resolved to ``1d`` or ``2d`` (pure, the same on every
    rank): what the plugin should run. A config without the field runs 1D."""
    mode = getattr(config.parallel, "tp_mode", "1d")  # type: ignore[attr-defined]
    if mode != "auto":
        return str(mode)
    return choose_for_config(config, world_size).mode
