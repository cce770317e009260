"""``colossal-hetero bench static``: planned uneven TP vs Colossal-AI's even TP, same run.

Per case (model, TP size, emulated speeds), one spawned world times three variants:

- ``homogeneous``: stock HybridParallelPlugin, even TP, no emulation (gives T_homo, C_homo);
- ``stock``: stock HybridParallelPlugin, even TP, ranks slowed to the case's speeds;
- ``planned``: HeteroParallelPlugin with the planner's uneven widths, same slowdowns.

ideal = T_homo - C_homo + C_homo * n / sum(speeds): compute spread exactly in proportion to
speed, communication as measured. speedup = stock / planned; efficiency = ideal / planned.

The variants run one training step each per round (``bench.rounds``), until both ratios'
95% intervals are within +-3% or the case's time budget is spent. Each round gives one
speedup and one efficiency from its own three steps; a ratio's value is their median over
rounds, with a bootstrap interval over rounds (``bench.stats``).
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from colossal_hetero.bench.measure import TrainingRunner
from colossal_hetero.bench.profile import agree, calibrate_model, measure_allreduce_gbps
from colossal_hetero.bench.rounds import Figure, RoundsPolicy, Variant, rank0_decides, run_rounds
from colossal_hetero.config.schema import (
    ClusterConfig,
    DeviceKind,
    DeviceSpec,
    EmulationConfig,
    HeteroConfig,
    ModelConfig,
    NetworkEmulationConfig,
    ParallelConfig,
    PlanConfig,
    SlowdownSpec,
)
from colossal_hetero.planner.batch_shares import batch_shares
from colossal_hetero.utils.device import device_kind

SEQ_LEN = 64
BATCH_SIZE = 4


@dataclass(frozen=True)
class Case:
    """One benchmark case: one rank per listed speed."""

    name: str
    model: ModelConfig
    speeds: tuple[float, ...]
    warmup: int = 2
    """Unrecorded rounds first."""
    min_rounds: int = 10
    """Recorded rounds before the driver may stop (see ``RoundsPolicy``)."""
    budget_s: float = 60.0
    """Wall seconds for the rounds (``run_benchmark`` sets it from the run's total budget)."""
    tp: int = 0
    """Tensor-parallel size; 0: every rank (no data parallelism)."""
    batch_size: int = BATCH_SIZE
    seq_len: int = SEQ_LEN
    link_gbps: float | None = None
    """Emulated link bandwidth for every variant (None: the host's loopback as it is)."""
    network_mode: Literal["model", "shaped"] = "model"
    """How a case with ``link_gbps`` gets its link: modelled by the interceptor, or real
    tc-shaped links (``bench static --network shaped``; root, CPU ranks; every variant runs on
    the same links). A case without a link runs on the host's loopback either way."""

    @property
    def world(self) -> int:
        """Ranks the case spawns."""
        return len(self.speeds)

    @property
    def tp_size(self) -> int:
        """Tensor-parallel group size."""
        return self.tp or self.world

    @property
    def equal(self) -> bool:
        """All ranks at the same speed."""
        return len(set(self.speeds)) == 1


def _gpt2(width: int = 384, heads: int = 12, layers: int = 2) -> ModelConfig:
    return ModelConfig(
        arch="gpt2",
        hf={
            "n_layer": layers,
            "n_embd": width,
            "n_head": heads,
            "n_positions": SEQ_LEN,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    )


def _llama(width: int = 384, heads: int = 12, layers: int = 2) -> ModelConfig:
    return ModelConfig(
        arch="llama",
        hf={
            "num_hidden_layers": layers,
            "hidden_size": width,
            "intermediate_size": 4 * width,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "max_position_embeddings": SEQ_LEN,
        },
    )


def cases(quick: bool) -> list[Case]:
    """The benchmark's cases; ``quick`` keeps one of each kind.

    Every case runs rounds until its ratios are known to +-3% or its budget is spent, so
    equal-speed cases (whose ratio is all noise and overhead) need no extra steps of their own.
    """
    selected = [
        Case("gpt2-tp2-[1,0.5]", _gpt2(), (1.0, 0.5)),
        Case("gpt2-tp2-equal", _gpt2(), (1.0, 1.0)),
        Case("llama-tp2-[1,0.5]", _llama(), (1.0, 0.5)),
        Case("gpt2-tp4-[1,1,0.5,0.25]", _gpt2(width=512, heads=16), (1.0, 1.0, 0.5, 0.25)),
    ]
    if not quick:
        selected += [
            Case("llama-tp4-[1,1,0.5,0.25]", _llama(width=512, heads=16), (1.0, 1.0, 0.5, 0.25)),
            Case("llama-tp2-equal", _llama(), (1.0, 1.0)),
            Case("gpt2-tp4-equal", _gpt2(width=512, heads=16), (1.0,) * 4),
            # Data parallelism on a slow link with few tokens: batch shares, and SFB where
            # the planner prices it below the weight all-reduce.
            Case(
                "gpt2-dp2-[1,0.5]-0.5gbps",
                _gpt2(width=768, heads=12),
                (1.0, 0.5),
                tp=1,
                batch_size=4,
                seq_len=16,
                link_gbps=0.5,
            ),
        ]
    return [replace(c, warmup=2 if quick else 3) for c in selected]


def _emulation(case: Case, *, slow_ranks: bool) -> EmulationConfig:
    fastest = max(case.speeds)
    slowdowns = [
        SlowdownSpec(rank=r, factor=fastest / s) for r, s in enumerate(case.speeds) if s < fastest
    ]
    network = case_network(case) or NetworkEmulationConfig()  # off: the loopback as it is
    return EmulationConfig(compute=slowdowns if slow_ranks else [], network=network)


def case_network(case: Case) -> NetworkEmulationConfig | None:
    """The case's link for every variant and for the launcher (``run_bench_ranks``); None
    without one."""
    if case.link_gbps is None:
        return None
    return NetworkEmulationConfig(mode=case.network_mode, bandwidth_gbps=case.link_gbps)


def _kind(device: torch.device) -> DeviceKind:
    return device_kind(device)


def run_case(rank: int, world_size: int, device: torch.device, case: Case) -> dict[str, Any]:
    """Spawned on every rank: profile, plan, and time the three variants."""
    from colossal_hetero.plugin import HeteroParallelPlugin, prepare_device

    prepare_device(device)
    # The planner's device model, calibrated on this machine: the model's own FLOP rate and
    # fixed per-layer cost (single-process steps), and the all-reduce bandwidth.
    rate, overhead = calibrate_model(case.model, case.batch_size, case.seq_len, device)
    tflops = agree(rate, device, "max") / 1e12
    overhead = agree(overhead, device, "min")
    gbps = agree(measure_allreduce_gbps(device), device, "min")
    if case.link_gbps is not None:
        gbps = min(gbps, case.link_gbps)
    devices = [DeviceSpec(speed=s, bandwidth_gbps=gbps) for s in case.speeds]
    config = HeteroConfig(
        parallel=ParallelConfig(tp=case.tp_size),
        cluster=ClusterConfig(device=_kind(device), devices=devices),
        emulation=_emulation(case, slow_ranks=True),
        plan=PlanConfig(mode="auto", reference_tflops=tflops, layer_overhead_us=overhead * 1e6),
    )
    even = HeteroConfig(
        parallel=config.parallel,
        cluster=ClusterConfig(device=_kind(device)),
        emulation=_emulation(case, slow_ranks=False),
    )
    shape: dict[str, Any] = {
        "batch_size": case.batch_size,
        "seq_len": case.seq_len,
        "device": device,
        "dp_rank": rank // case.tp_size,
    }
    results: dict[str, Any] = {
        "reference_tflops": tflops,
        "allreduce_gbps": gbps,
        "layer_overhead_s": overhead,
    }
    # Three plugins live side by side in this process; their interceptors share one wrapper
    # layer, and the planned one's emulation equals the stock one's (a conflict is refused).
    hetero = HeteroParallelPlugin(config, workload=(case.batch_size, case.seq_len))
    try:
        return _time_variants(case, config, even, hetero, results, shape)
    finally:
        hetero.close()


def _time_variants(
    case: Case,
    config: HeteroConfig,
    even: HeteroConfig,
    hetero: Any,
    results: dict[str, Any],
    shape: dict[str, Any],
) -> dict[str, Any]:
    """Time the three variants interleaved; ``results`` gains their measurements and plan."""
    import torch.distributed as dist
    from colossalai.booster.plugin import HybridParallelPlugin

    from colossal_hetero.emulation import build_interceptor
    from colossal_hetero.plugin.engine import engine_kwargs

    rank, world_size, device = dist.get_rank(), dist.get_world_size(), shape["device"]
    even_shares = batch_shares(even, world_size, case.world // case.tp_size, case.batch_size)
    runners = {
        "homogeneous": TrainingRunner(
            case.model,
            HybridParallelPlugin(**engine_kwargs(even, device)),
            build_interceptor(even.emulation, rank, world_size, device),
            shares=even_shares,
            emulated=even.emulation.enabled,
            **shape,
        ),
        "stock": TrainingRunner(
            case.model,
            HybridParallelPlugin(**engine_kwargs(even, device)),
            build_interceptor(config.emulation, rank, world_size, device),
            shares=even_shares,
            emulated=config.emulation.enabled,
            **shape,
        ),
    }
    # The plugin plans at boost time; the runner then takes the plan's batch shares.
    runners["planned"] = TrainingRunner(case.model, hetero, shares=even_shares, **shape)
    policy = RoundsPolicy(warmup=case.warmup, min_rounds=case.min_rounds, budget_s=case.budget_s)
    variants = {name: _one_step(runner, world_size) for name, runner in runners.items()}
    try:
        rounds = run_rounds(variants, _figures(case), policy, decide=rank0_decides(device))
    finally:
        for runner in runners.values():
            runner.close()
    results["rounds"] = rounds.to_dict()
    for name, runner in runners.items():
        results[name] = runner.measurement().to_dict()
    plan = hetero.plan
    results["plan"] = {
        "widths": plan.widths if plan and plan.widths else None,
        "group_samples": list(plan.group_samples) if plan else even_shares,
        "sfb_layers": [la.name for la in plan.layers if la.grad_sync == "sfb"] if plan else [],
        "predicted_speedup": plan.speedup if plan else 1.0,
    }
    return results


def _one_step(runner: TrainingRunner, world_size: int) -> Variant:
    """A round of one variant: one training step; the slowest rank's step time (``step``) and
    the ranks' mean compute time (``compute``), both from the runner's all_gather, so every
    rank returns the same numbers.
    """

    def step(index: int, *, warmup: bool) -> dict[str, float] | None:
        runner.step(index, record=not warmup)
        if warmup:
            return None
        row = runner.rows[-1]  # per rank: step time, compute time, comm wait, loss
        width = len(row) // world_size
        ranks = range(world_size)
        return {
            "step": max(row[r * width] for r in ranks),
            "compute": sum(row[r * width + 1] for r in ranks) / world_size,
        }

    return step


def _figures(case: Case) -> dict[str, Figure]:
    """Per-round speedup and efficiency (see the module docstring) from one round's series."""
    scale = case.world / sum(s / max(case.speeds) for s in case.speeds)

    def ideal(v: Any) -> float:
        c_homo = v["homogeneous.compute"]
        return v["homogeneous.step"] - c_homo + c_homo * scale

    return {
        "speedup": lambda v: v["stock.step"] / v["planned.step"],
        "efficiency": lambda v: ideal(v) / v["planned.step"],
    }


def summarise(case: Case, result: dict[str, Any]) -> dict[str, Any]:
    """One case's medians, ratios and their 95% intervals (``*_ci``: ``[low, high]``).

    Step times are medians over rounds; ``ideal_step_time`` is the bound computed from the
    homogeneous medians; ``speedup`` and ``efficiency`` are medians of per-round ratios.
    """
    rounds = result["rounds"]
    medians, figures = rounds["medians"], rounds["figures"]
    scale = case.world / sum(s / max(case.speeds) for s in case.speeds)
    homo, c_homo = medians["homogeneous.step"]["value"], medians["homogeneous.compute"]["value"]
    row: dict[str, Any] = {
        "case": case.name,
        "tp": case.tp_size,
        "dp": case.world // case.tp_size,
        "link_gbps": case.link_gbps,
        "speeds": list(case.speeds),
        "arch": case.model.arch,
    }
    for variant in ("stock", "planned", "homogeneous"):
        row[f"{variant}_step_time"] = medians[f"{variant}.step"]["value"]
        row[f"{variant}_step_time_ci"] = medians[f"{variant}.step"]["ci"]
    row["homogeneous_compute_time"] = c_homo
    row["ideal_step_time"] = homo - c_homo + c_homo * scale
    for figure in ("speedup", "efficiency"):
        row[figure] = figures[figure]["value"]
        row[f"{figure}_ci"] = figures[figure]["ci"]
    row.update(
        rounds=rounds,
        plan=result["plan"],
        per_rank={k: result[k] for k in ("homogeneous", "stock", "planned")},
        reference_tflops=result["reference_tflops"],
        layer_overhead_s=result["layer_overhead_s"],
        allreduce_gbps=result["allreduce_gbps"],
    )
    return row


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures the targets name, each with its 95% interval and the case it comes from.

    ``worst_efficiency``: the lowest efficiency among cases with unequal speeds;
    ``equal_speed_ratio``: the lowest speedup among equal-speed cases (planned vs stock doing
    identical work). A key is absent when no selected case has that kind. ``converged``:
    every ratio of every case reached +-3%; ``max_half_width``: the widest one reached.
    """
    out: dict[str, Any] = {}
    picks = (
        ("worst_efficiency", "efficiency", [r for r in rows if len(set(r["speeds"])) > 1]),
        ("equal_speed_ratio", "speedup", [r for r in rows if len(set(r["speeds"])) == 1]),
    )
    for key, figure, candidates in picks:
        if candidates:
            worst = min(candidates, key=operator.itemgetter(figure))
            out[key] = worst[figure]
            out[f"{key}_ci"] = worst[f"{figure}_ci"]
            out[f"{key}_case"] = worst["case"]
    out["converged"] = all(r["rounds"]["converged"] for r in rows)
    out["max_half_width"] = max(r["rounds"]["max_half_width"] for r in rows)
    return out


def planning_time_1p5b() -> float:
    """Seconds to plan a 48-layer GPT (1.5B) for 64 heterogeneous devices (TP 8 x DP 8)."""
    import transformers

    from colossal_hetero.planner import ClusterSpec, model_spec_from_hf, search_plan
    from colossal_hetero.planner.search import Space

    hf = transformers.GPT2Config(n_layer=48, n_embd=1600, n_head=25, n_positions=1024)
    speeds = [(1.0, 0.6, 0.35)[i % 3] for i in range(64)]
    cluster = ClusterSpec.from_relative(speeds)
    model = model_spec_from_hf(hf, batch_size=256, seq_len=1024, dtype_bytes=2)
    started = time.perf_counter()
    search_plan(cluster, model, tp_size=8, space=Space.MEGATRON)
    return time.perf_counter() - started
