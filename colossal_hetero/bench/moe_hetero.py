"""The heterogeneous case of ``bench moe``: speed-aware vs even expert placement.

EP=4 on 4 CPU ranks with device speeds [1, 1, 0.5, 0.5], emulated by the plugin's own
compute slowdown (``emulation.compute: from_cluster``: a slow rank sleeps in proportion to the
CPU time it really spent computing since its last collective, so its extra time scales with
the expert work it really did). A small Mixtral (8 experts, top-2, fp32, experts wide so that
expert work dominates the step) trains with skewed routing: a fixed router bias makes experts
4-7 hot, which Colossal-AI's contiguous layout puts on the two slow ranks (the case the issue
describes: a hot expert on a slow device sets everyone's pace). The skew is stated here and
in the JSON, not hidden.

Two copies of the model from the same weights, trained on the same batches, measured in
interleaved rounds (``bench.rounds``), one step per variant per round:
- ``even``: the contiguous placement, fixed;
- ``speed_aware``: ``moe.replace_every``: the seam controller re-places the experts from the
  router loads it measured and the ranks' speeds, moving weights and AdamW state (during the
  warm-up rounds the first time; later decisions are in the timed steps, if any move);
- ``speed_aware_packed``: the same with expert packing (moe.packing) in the dispatch.
Also per step: the bytes all ranks handed to all-to-all calls (the interceptor's count:
forward and backward, local rows included), and, for the packed copy, the forward rows and
bytes the blocks account for their tokens sent to other ranks, packed and as unpacked.
Per step: the slowest rank's wall time. Reported: the paired ratio even / speed_aware with
its 95% interval, the placements decided, and the loss of both on held batches (equal up to
fp32 rounding: a placement changes where experts run, not what they compute).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

HF = {
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 128,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.0,  # no pull back to balance: the skew stays as measured
}
SPEEDS = [1.0, 1.0, 0.5, 0.5]
HOT_BIAS = [0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5]  # added to the router logits
SEQ, PER_RANK, EP, REPLACE_EVERY = 64, 4, 4, 4


def _build(replace_every: int, packing: bool = False) -> tuple[Any, Any, Any, Any]:
    from colossalai.booster import Booster
    from transformers import MixtralConfig, MixtralForCausalLM

    from colossal_hetero.config.moe import MoeConfig
    from colossal_hetero.config.parallel import ParallelConfig
    from colossal_hetero.config.schema import (
        ClusterConfig,
        DeviceSpec,
        EmulationConfig,
        HeteroConfig,
        PlanConfig,
    )
    from colossal_hetero.plugin import HeteroParallelPlugin

    config = HeteroConfig(
        parallel=ParallelConfig(ep=EP),
        moe=MoeConfig(chunk_kib=256, replace_every=replace_every, packing=packing),
        cluster=ClusterConfig(devices=[DeviceSpec(speed=s) for s in SPEEDS]),
        emulation=EmulationConfig(compute="from_cluster"),
        plan=PlanConfig(mode="even"),  # no tensor-parallel widths to plan at tp = 1
    )
    plugin = HeteroParallelPlugin(config)
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**HF))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    bias = torch.tensor(HOT_BIAS)
    for layer in model.unwrap().model.layers:  # before the load meter's hook: it sees the skew
        gate = layer.block_sparse_moe.gate
        gate.register_forward_hook(lambda m, i, out: out + bias, prepend=True)
    return booster, model, optimizer, plugin


def _step(booster: Any, model: Any, optimizer: Any, ids: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    booster.backward(loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def _slowest(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def hetero_worker(rank: int, world_size: int, device: torch.device, *, quick: bool) -> dict:
    """One rank of the heterogeneous case; returns the rounds' JSON and the decisions."""
    from colossal_hetero.bench.rounds import RoundsPolicy, rank0_decides, run_rounds
    from colossal_hetero.utils.quiet import quiet_third_party_warnings

    quiet_third_party_warnings()
    torch.set_num_threads(1)
    runs = {
        "even": _build(0),
        "speed_aware": _build(REPLACE_EVERY),
        "speed_aware_packed": _build(REPLACE_EVERY, packing=True),
    }
    generator = torch.Generator().manual_seed(1234)
    drawn: list[torch.Tensor] = []

    def batch(index: int) -> torch.Tensor:
        while len(drawn) <= index:
            shape = (world_size * PER_RANK, SEQ)
            drawn.append(torch.randint(0, 256, shape, generator=generator))
        return drawn[index].split(PER_RANK)[rank]

    def variant(name: str) -> Any:
        def run(index: int, *, warmup: bool) -> dict[str, float]:
            booster, model, optimizer, plugin = runs[name]
            step = _step(booster, model, optimizer, batch(index))
            timing = plugin.seam.last_timing  # bytes this rank handed to all-to-all calls
            sent = 0 if timing is None else timing.bytes_by_kind.get("all_to_all", 0)
            total = torch.tensor([float(sent)], dtype=torch.float64)
            dist.all_reduce(total)
            return {"step": _slowest(step), "a2a_bytes": float(total)}

        return run

    policy = RoundsPolicy(
        warmup=REPLACE_EVERY + 1, min_rounds=8 if quick else 12, budget_s=40 if quick else 240
    )
    result = run_rounds(
        {name: variant(name) for name in runs},
        {
            "speed_aware_vs_even": lambda v: v["even.step"] / v["speed_aware.step"],
            "packed_vs_unpacked": lambda v: v["speed_aware.step"] / v["speed_aware_packed.step"],
        },
        policy,
        decide=rank0_decides(device),
    )
    losses = _held_losses(runs, batch, len(drawn))
    decisions = runs["speed_aware"][3].moe_replacer.writer.records
    packing = _packing_stats(runs["speed_aware_packed"][1])
    for *_, plugin in runs.values():
        plugin.close()
    return {
        "rounds": result.to_dict(),
        "losses": losses,
        "decisions": decisions,
        "packing": packing,
    }


def _packing_stats(model: Any) -> dict[str, float]:
    """The packed blocks' accounted forward a2a traffic of their own tokens (moe/packed.py),
    summed over layers and ranks, over the whole run."""
    from colossal_hetero.moe.block import HeteroEPMixtralSparseMoeBlock

    keys = ("rows_packed", "rows_unpacked", "bytes_packed", "bytes_unpacked")
    totals = torch.zeros(len(keys), dtype=torch.float64)
    for block in model.modules():
        stats = getattr(block, "packing_stats", None)
        if isinstance(block, HeteroEPMixtralSparseMoeBlock) and stats is not None:
            totals += torch.tensor([float(getattr(stats, k)) for k in keys], dtype=torch.float64)
    dist.all_reduce(totals)
    return dict(zip(keys, totals.tolist(), strict=True))


def _held_losses(runs: dict[str, Any], batch: Any, n: int) -> dict[str, float]:
    """Mean loss of each variant over the first batches (forward only, after training)."""
    out = {}
    with torch.no_grad():
        for name, (_, model, _, _) in runs.items():
            values = [float(model(input_ids=batch(i), labels=batch(i)).loss) for i in range(4)]
            tensor = torch.tensor([sum(values) / len(values)], dtype=torch.float64)
            dist.all_reduce(tensor)
            out[name] = float(tensor) / dist.get_world_size()
    return out


def run_hetero_case(*, quick: bool) -> dict[str, Any]:
    """Spawn the case on 4 ranks (loopback, no link shaping); its JSON section."""
    from colossal_hetero.bench.shaped_spawn import run_bench_ranks

    started = time.perf_counter()
    result = run_bench_ranks(hetero_worker, 4, network=None, quick=quick)[0]
    figure = result["rounds"]["figures"]["speed_aware_vs_even"]
    medians = result["rounds"]["medians"]
    first = next((r for r in result["decisions"] if any(x["moved"] for x in r["layers"])), None)
    return {
        "layout": f"EP={EP} on 4 ranks",
        "model": HF,
        "device_speeds": SPEEDS,
        "router_bias": HOT_BIAS,
        "seq_len": SEQ,
        "per_rank_batch": PER_RANK,
        "precision": "fp32",
        "network_mode": "none",
        "speed_aware_vs_even_placement": float(figure["value"]),
        "speed_aware_vs_even_placement_ci": figure["ci"],
        "packed_vs_unpacked": result["rounds"]["figures"]["packed_vs_unpacked"]["value"],
        "packed_vs_unpacked_ci": result["rounds"]["figures"]["packed_vs_unpacked"]["ci"],
        "a2a_bytes_per_step": {
            name: medians[f"{name}.a2a_bytes"]["value"]
            for name in ("even", "speed_aware", "speed_aware_packed")
        },
        "packing_accounted": result["packing"],
        "even_step_s": medians["even.step"]["value"],
        "speed_aware_step_s": medians["speed_aware.step"]["value"],
        "first_move": first,
        "decisions": len(result["decisions"]),
        "decisions_that_moved": sum(
            any(x["moved"] for x in r["layers"]) for r in result["decisions"]
        ),
        "held_loss": result["losses"],
        "wall_s": time.perf_counter() - started,
        "rounds": result["rounds"],
    }
