"""``colossal-hetero bench static``: planned uneven TP vs Colossal-AI's even TP, same run.

Per case (model, TP size, emulated speeds), one spawned world times three variants:

- ``homogeneous``: stock HybridParallelPlugin, even TP, no emulation (gives T_homo, C_homo);
- ``stock``: stock HybridParallelPlugin, even TP, ranks slowed to the case's speeds;
- ``planned``: HeteroParallelPlugin with the planner's uneven widths, same slowdowns.

ideal = T_homo - C_homo + C_homo * n / sum(speeds): compute spread exactly in proportion to
speed, communication as measured. speedup = stock / planned; efficiency = ideal / planned.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from colossal_hetero.bench.measure import Measurement, TrainingRunner, run_interleaved
from colossal_hetero.bench.profile import agree, calibrate_model, measure_allreduce_gbps
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

SEQ_LEN = 64
BATCH_SIZE = 4


@dataclass(frozen=True)
class Case:
    """One benchmark case: one rank per listed speed."""

    name: str
    model: ModelConfig
    speeds: tuple[float, ...]
    steps: int = 8
    warmup: int = 2
    tp: int = 0
    """Tensor-parallel size; 0: every rank (no data parallelism)."""
    batch_size: int = BATCH_SIZE
    seq_len: int = SEQ_LEN
    link_gbps: float | None = None
    """Emulated link bandwidth for every variant (None: the host's loopback as it is)."""

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

    Equal-speed cases compare identical work (no plan applies), so their ratio is all noise
    and overhead: they run more steps, which are cheap without slow ranks.
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
    steps, warmup = (8, 2) if quick else (15, 3)
    return [replace(c, steps=3 * steps if c.equal else steps, warmup=warmup) for c in selected]


def _emulation(case: Case, *, slow_ranks: bool) -> EmulationConfig:
    fastest = max(case.speeds)
    slowdowns = [
        SlowdownSpec(rank=r, factor=fastest / s) for r, s in enumerate(case.speeds) if s < fastest
    ]
    network = NetworkEmulationConfig()  # off: the host's loopback as it is
    if case.link_gbps is not None:
        network = NetworkEmulationConfig(bandwidth_gbps=case.link_gbps)
    return EmulationConfig(compute=slowdowns if slow_ranks else [], network=network)


def _kind(device: torch.device) -> DeviceKind:
    return "cuda" if device.type == "cuda" else "cpu"


def run_case(rank: int, world_size: int, device: torch.device, case: Case) -> dict[str, Any]:
    """Spawned on every rank: profile, plan, and time the three variants."""
    from colossalai.booster.plugin import HybridParallelPlugin

    from colossal_hetero.emulation import build_interceptor
    from colossal_hetero.plugin import HeteroParallelPlugin, prepare_device
    from colossal_hetero.plugin.engine import engine_kwargs

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
    dp_size = case.world // case.tp_size
    dp_rank = rank // case.tp_size
    even_shares = batch_shares(even, world_size, dp_size, case.batch_size)
    shape: dict[str, Any] = {
        "batch_size": case.batch_size,
        "seq_len": case.seq_len,
        "device": device,
        "dp_rank": dp_rank,
    }
    results: dict[str, Any] = {
        "reference_tflops": tflops,
        "allreduce_gbps": gbps,
        "layer_overhead_s": overhead,
    }

    hetero = HeteroParallelPlugin(config, workload=(case.batch_size, case.seq_len))
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
    runners["planned"] = TrainingRunner(
        case.model, hetero, hetero.timer, shares=even_shares, **shape
    )
    run_interleaved(list(runners.values()), warmup=case.warmup, steps=case.steps)
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


def summarise(case: Case, result: dict[str, Any]) -> dict[str, Any]:
    """Ratios and the ideal bound of one case (see the module docstring)."""
    homo, stock, planned = (Measurement(**result[k]) for k in ("homogeneous", "stock", "planned"))
    n = case.world
    speeds = [s / max(case.speeds) for s in case.speeds]
    c_homo = sum(homo.compute_time) / n
    ideal = homo.step_time - c_homo + c_homo * n / sum(speeds)
    return {
        "case": case.name,
        "tp": case.tp_size,
        "dp": case.world // case.tp_size,
        "link_gbps": case.link_gbps,
        "speeds": list(case.speeds),
        "arch": case.model.arch,
        "stock_step_time": stock.step_time,
        "planned_step_time": planned.step_time,
        "homogeneous_step_time": homo.step_time,
        "homogeneous_compute_time": c_homo,
        "ideal_step_time": ideal,
        "speedup": stock.step_time / planned.step_time,
        "efficiency": ideal / planned.step_time,
        "plan": result["plan"],
        "per_rank": {k: result[k] for k in ("homogeneous", "stock", "planned")},
        "reference_tflops": result["reference_tflops"],
        "layer_overhead_s": result["layer_overhead_s"],
        "allreduce_gbps": result["allreduce_gbps"],
    }


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
