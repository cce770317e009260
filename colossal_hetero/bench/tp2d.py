"""``colossal-hetero bench tp2d``: 2D (SUMMA) against stock 1D tensor parallelism, tp = 4.

One spawned world of 4 CPU ranks holds five models of the same GPT-2 (same seed and weights):

- ``1d``: stock Colossal-AI ``HybridParallelPlugin``, tp_size 4;
- ``1d_sp``: the same with Colossal-AI's sequence parallelism (``split_gather``), which also
  splits LayerNorm and dropout activations along the sequence: the fair memory baseline;
- ``2d``: ``tp2d.GPT2LM2D`` on a 2 x 2 mesh, even blocks;
- ``2d_even_slow`` / ``2d_resized_slow``: 2D with one device at half speed (emulated: the
  interceptor stretches each compute interval of rank 3 by its CPU time, so the extra time
  scales with the work the rank really did), even blocks against the planner's placement and
  block sizes (``planner.tp2d_plan.plan_resizable_2d``, proportional blocks). Each rank's
  fixed work per step is measured too (``measure_overhead``: the even 2D model's CPU time at
  two batch sizes, an affine fit) and recorded with the plan it would give
  (``resized_plan.calibration``), not run: it measured slower (docs/tp2d.md);
- ``2d_zero_slow``: even 2D blocks, the slow rank ZERO-resized inside the SUMMA steps
  (``tp2d.resize``: every Linear2D's GEMMs over ``kept_fraction(slowdown)`` of the reduction
  entries, the first ones; every collective unchanged): the in-layer alternative to resizing
  the blocks, at the cost of an approximate gradient.

Measured per rank, once: activation bytes of one forward at the benchmark batch
(``bench.tp2d_measure``: every storage the autograd graph keeps, parameters excluded), and,
for 1d, 1d_sp and 2d, the largest batch whose state (weights, gradients, AdamW moments) plus
activation bytes fit ``budget_mib`` per rank, found by running forwards (doubling, then
bisection; the worst rank decides). Then training steps in interleaved rounds
(``bench.rounds``): step time (slowest rank), payload bytes sent (all ranks) and collective
calls, per variant, with paired per-round ratios and 95% intervals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from colossal_hetero.bench.rounds import Figure, RoundsPolicy, Variant, rank0_decides, run_rounds
from colossal_hetero.bench.tp2d_measure import largest_fitting, sequence_parallel_on_gloo
from colossal_hetero.bench.tp2d_runners import (
    OneDRunner,
    TwoDRunner,
    activation_bytes,
    build_dedicated,
    text_batch,
    timed_step,
    world_max,
    world_sum,
)
from colossal_hetero.config.schema import EmulationConfig, ModelConfig, SlowdownSpec
from colossal_hetero.planner.tp2d_plan import plan_resizable_2d

MIB = 2**20
UNSLOWED = ("1d", "1d_sp", "2d")
VARIANTS = (*UNSLOWED, "2d_even_slow", "2d_resized_slow", "2d_zero_slow")


@dataclass(frozen=True)
class Tp2dCase:
    """The benchmark's model, batch, speeds, memory budget and rounds policy."""

    layers: int = 2
    hidden: int = 768
    heads: int = 12
    vocab: int = 256
    seq_len: int = 32
    batch_size: int = 12
    speeds: tuple[float, ...] = (1.0, 1.0, 1.0, 0.5)
    device_slowdown: float = 16.0
    """Every emulated device computes this many times slower than a host core (the slow one
    twice that): four ranks on a two-core host would otherwise queue for the cores, and a
    rank's emulated idle time would go to its neighbours (see ``_slowdowns``)."""
    budget_mib: float = 100.0
    """Per-rank memory budget for the maximum-batch search (state + activations)."""
    max_batch_limit: int = 256
    warmup: int = 2
    min_rounds: int = 10
    budget_s: float = 120.0
    seed: int = field(default=0)

    @property
    def world(self) -> int:
        return len(self.speeds)

    @property
    def ffn(self) -> int:
        return 4 * self.hidden

    def model(self) -> ModelConfig:
        """The GPT-2 every variant trains (dropout 0: 2D GPT-2 needs it)."""
        return ModelConfig(
            arch="gpt2",
            hf={
                "n_layer": self.layers,
                "n_embd": self.hidden,
                "n_head": self.heads,
                "n_positions": self.seq_len,
                "vocab_size": self.vocab,
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "attn_pdrop": 0.0,
            },
            init_seed=self.seed,
        )


def even_shares(case: Tp2dCase, batch: int) -> Any:
    """Even 2 x 2 blocks (batch split as evenly as it goes)."""
    from colossal_hetero.tp2d.gpt2 import GPT2Shares
    from colossal_hetero.tp2d.layout import even_sizes

    q = 2
    return GPT2Shares(
        even_sizes(batch, q),
        even_sizes(case.heads, q),
        even_sizes(case.ffn, q),
        even_sizes(case.vocab, q),
    )


def resized_shares(
    case: Tp2dCase, overhead: float = 0.0
) -> tuple[Any, dict[int, tuple[int, int]], dict[str, Any]]:
    """The planner's shares and placement for ``case.speeds`` (``overhead``: each rank's fixed
    work in sample-heads, see ``measure_overhead``); and a JSON record of them."""
    from colossal_hetero.tp2d.gpt2 import GPT2Shares

    plan = plan_resizable_2d(
        case.speeds, case.batch_size, case.heads, case.ffn, case.vocab, overhead=overhead
    )
    shares = GPT2Shares(plan.batch_sizes, plan.head_counts, plan.ffn_sizes, plan.vocab_sizes)
    record = {
        "positions": list(plan.positions),
        "batch_sizes": list(plan.batch_sizes),
        "head_counts": list(plan.head_counts),
        "ffn_sizes": list(plan.ffn_sizes),
        "vocab_sizes": list(plan.vocab_sizes),
        "predicted_speedup": plan.predicted_speedup,
        "exact": plan.exact,
        "overhead_sample_heads": overhead,
    }
    return shares, plan.placement(), record


def zero_resize_slowest(case: Tp2dCase, runner: Any) -> dict[str, Any]:
    """ZERO-resize the slowest device's GEMMs in every Linear2D of ``runner``'s model: it keeps
    ``kept_fraction(fastest / its speed)`` of each reduction dimension (the accuracy budget's
    default floor 0.5). Returns a JSON record."""
    from colossal_hetero.balance.ops.selection import kept_fraction
    from colossal_hetero.tp2d.resize import attach_resize_2d, kept_for_slowdown

    slow = min(range(len(case.speeds)), key=lambda r: (case.speeds[r], r))
    slowdown = max(case.speeds) / case.speeds[slow]
    position = runner.model.mesh.layout.position(slow)  # the world is the mesh: rank = device
    attach_resize_2d(runner.model, {position: kept_for_slowdown(runner.model, position, slowdown)})
    return {
        "rank": slow,
        "position": list(position),
        "slowdown": slowdown,
        "kept_fraction": kept_fraction(slowdown),
    }


def _slowdowns(case: Tp2dCase) -> EmulationConfig:
    """Rank r computes ``device_slowdown * fastest / speed_r`` times slower than the host.

    Slowing only the slow rank cannot show a better layout on a host with fewer cores than
    ranks: while it sleeps its core serves the other ranks, so the step is bound by the total
    CPU work, which no layout changes. With every rank slowed, each one's compute is its own
    CPU time stretched (the interceptor stretches CPU time, not wall time), the ranks need
    less than a core each on average, and the step is bound by the slowest block again.
    """
    fastest = max(case.speeds)
    return EmulationConfig(
        compute=[
            SlowdownSpec(rank=r, factor=case.device_slowdown * fastest / s)
            for r, s in enumerate(case.speeds)
        ]
    )


def run_case(rank: int, world_size: int, device: torch.device, case: Tp2dCase) -> dict[str, Any]:
    """Spawned on every rank: build the five variants, measure, time them in rounds."""
    from colossal_hetero.emulation import build_interceptor
    from colossal_hetero.plugin import prepare_device

    if world_size != 4:
        raise ValueError(f"bench tp2d runs on 4 ranks (a 2 x 2 mesh), got {world_size}")
    prepare_device(device)
    model = case.model()
    with sequence_parallel_on_gloo():
        runners: dict[str, Any] = {
            "1d": OneDRunner(model, device, sequence_parallel=False),
            "1d_sp": OneDRunner(model, device, sequence_parallel=True),
            "2d": TwoDRunner(model, device, even_shares(case, case.batch_size)),
        }
        runners["2d_even_slow"] = TwoDRunner(model, device, even_shares(case, case.batch_size))
        # Recorded, not planned with: in a paired run (docs/tp2d.md) the plan with the
        # measured overhead (heads 9 / 3) stepped 0.965x as fast as the proportional one.
        calibration = measure_overhead(case, runners, device)
        shares, placement, planned = resized_shares(case)
        calibrated = resized_shares(case, calibration["overhead"])[2]
        planned["calibration"] = {
            **calibration,
            "head_counts": calibrated["head_counts"],
            "batch_sizes": calibrated["batch_sizes"],
            "predicted_speedup": calibrated["predicted_speedup"],
        }
        runners["2d_resized_slow"] = TwoDRunner(model, device, shares, placement)
        runners["2d_zero_slow"] = TwoDRunner(model, device, even_shares(case, case.batch_size))
        result: dict[str, Any] = {"resized_plan": planned}
        result["zero_resize"] = zero_resize_slowest(case, runners["2d_zero_slow"])
        result["memory"] = _memory(case, runners, device)
        timer = build_interceptor(EmulationConfig(), rank, world_size, device).install()
        slow = build_dedicated(_slowdowns(case), rank, world_size, device).install()
        try:
            result["rounds"] = _rounds(case, runners, timer, slow, device)
        finally:
            slow.uninstall()
            timer.uninstall()
    return result


def _memory(case: Tp2dCase, runners: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Activation and state bytes at the benchmark batch (max over ranks, and per rank), and
    the largest batch within the budget, for the unslowed variants."""
    batch = text_batch(case.batch_size, case.seq_len, 10_000, case.vocab)
    out: dict[str, Any] = {"budget_mib": case.budget_mib}
    for name in UNSLOWED:
        runner = _with_batch(runners, name, case, case.batch_size)
        measured = activation_bytes(runner, batch)
        per_rank = _gather_floats([measured["activation"], measured["state"]], device)
        out[name] = {
            "activation_bytes": max(per_rank[0::2]),
            "activation_bytes_per_rank": per_rank[0::2],
            "state_bytes": max(per_rank[1::2]),
        }
    budget = case.budget_mib * MIB
    for name in UNSLOWED:

        def fits(b: int, name: str = name) -> bool:
            runner = _with_batch(runners, name, case, b)
            measured = activation_bytes(runner, text_batch(b, case.seq_len, 10_001, case.vocab))
            (worst,) = world_max([measured["activation"] + measured["state"]], device)
            return worst <= budget

        out[name]["max_batch"] = largest_fitting(fits, start=16, limit=case.max_batch_limit)
    _with_batch(runners, "2d", case, case.batch_size)  # back to the timed batch
    return out


def measure_overhead(
    case: Tp2dCase, runners: dict[str, Any], device: torch.device, repeats: int = 3
) -> dict[str, float]:
    """Each rank's fixed work per step, in sample-heads (the planner's ``overhead``).

    The even 2D model runs forward and backward (no update) at the benchmark batch and at
    half of it; a rank's CPU time (its thread's, so waits and other processes do not count)
    is affine in its block b_i a_j: t = c + w b_i a_j. Two sizes give c / w; the mean over the
    ranks (one all_reduce) is what every rank plans with. Medians of ``repeats`` steps.
    """
    import time

    from colossal_hetero.tp2d.layout import even_sizes

    q, head_share = 2, even_sizes(case.heads, 2)[0]
    sizes = (case.batch_size, case.batch_size // 2)
    times = []
    for batch_size in sizes:
        runner = _with_batch(runners, "2d", case, batch_size)
        samples = []
        for k in range(repeats):
            batch = text_batch(batch_size, case.seq_len, 20_000 + k, case.vocab)
            start = time.thread_time()
            runner.forward(batch).backward()
            samples.append(time.thread_time() - start)
            runner.optimizer.zero_grad()
        times.append(sorted(samples)[repeats // 2])
    _with_batch(runners, "2d", case, case.batch_size)
    units = [even_sizes(b, q)[0] * head_share for b in sizes]
    slope = (times[0] - times[1]) / (units[0] - units[1])
    fixed = times[0] - slope * units[0]
    overhead = max(fixed, 0.0) / slope if slope > 0 else 0.0
    (mean,) = world_sum([overhead / dist.get_world_size()], device)
    return {"overhead": mean, "rank_fixed_s": fixed, "rank_per_unit_s": slope}


def _with_batch(runners: dict[str, Any], name: str, case: Tp2dCase, batch: int) -> Any:
    """The runner; a 2D one gets row shares for ``batch`` (its blocks do not depend on it)."""
    runner = runners[name]
    if isinstance(runner, TwoDRunner) and sum(runner.model.shares.batch_sizes) != batch:
        heads, ffn, vocab = (
            runner.model.shares.head_counts,
            runner.model.shares.ffn_sizes,
            runner.model.shares.vocab_sizes,
        )
        from colossal_hetero.tp2d.gpt2 import GPT2Shares
        from colossal_hetero.tp2d.layout import even_sizes

        runner.model.shares = GPT2Shares(even_sizes(batch, 2), heads, ffn, vocab)
    return runner


def _gather_floats(values: list[float], device: torch.device) -> list[float]:
    import torch.distributed as dist

    mine = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [float(v) for v in torch.cat(gathered).tolist()]


def _rounds(
    case: Tp2dCase, runners: dict[str, Any], timer: Any, slow: Any, device: torch.device
) -> dict[str, Any]:
    def variant(name: str) -> Variant:
        interceptor = slow if name.endswith("_slow") else timer

        def one(index: int, *, warmup: bool) -> dict[str, float] | None:
            batch = text_batch(case.batch_size, case.seq_len, index, case.vocab)
            values = timed_step(runners[name], interceptor, index, batch)
            return None if warmup else values

        return one

    policy = RoundsPolicy(
        warmup=case.warmup, min_rounds=case.min_rounds, budget_s=case.budget_s, seed=case.seed
    )
    variants = {name: variant(name) for name in VARIANTS}
    return run_rounds(variants, figures(), policy, decide=rank0_decides(device)).to_dict()


def figures() -> dict[str, Figure]:
    """Per-round step-time ratios (> 1: the second-named variant is faster)."""
    return {
        "step_1d_over_2d": lambda v: v["1d.step"] / v["2d.step"],
        "step_1d_sp_over_2d": lambda v: v["1d_sp.step"] / v["2d.step"],
        "resizable_vs_even_2d": lambda v: v["2d_even_slow.step"] / v["2d_resized_slow.step"],
        "zero_resize_vs_even_2d": lambda v: v["2d_even_slow.step"] / v["2d_zero_slow.step"],
    }
