"""``colossal-hetero bench moe``: a small Mixtral, EP=2 x DP=2 on 4 CPU ranks, on shaped links.

The stock ``MoeHybridParallelPlugin`` (ZeRO-1, its only EP x DP layout) against ours
(``HeteroParallelPlugin`` with ``parallel.ep``) in the settings of ``VARIANTS``, and
DeepSpeed-MoE (bench/moe_deepspeed.py). All in bf16 (the stock plugin's ZeRO refuses fp32),
built in one world from the same initial weights, trained on the same batches and measured in
interleaved rounds (``bench.rounds``), one timed training step per variant per round, each
after an untimed priming step at learning rate 0 on the same batch (bench/moe_prime.py: the
timed step runs with its expert kernels compiled, as in steady-state training), every rank of
every variant on the same emulated device (bench/moe_devices.py).

Per step and variant: the slowest rank's step time; the time inside synchronous collectives
(our reducer's async chunks are not counted, they overlap); for ours, the a2a transfer times
(:func:`_a2a_medians`: from the last rank's arrival to the end) of the forward ("alone": no
gradient exists yet) and of the backward (gradient chunks are reduced around them), the share
of a2a calls with a chunk on the wire, the world's a2a bytes. Placement: bench/moe_hetero.py.

The EP=4 section (``EP4_VARIANTS``) runs in the same rounds: the stock plugin, ours all on and
DeepSpeed-MoE with EP=4 on the same 4 ranks (one expert per rank, no expert replicas), from
the same weights and batches. The warm-up (``WARMUP``) covers all on's pipelining choice and
its trial (moe/pipeline_choice.py), so that no measured step runs a setting it then drops.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from colossal_hetero.bench.moe_deepspeed import baseline_round_entries
from colossal_hetero.bench.moe_devices import CollectiveTimer, transfer_time
from colossal_hetero.bench.moe_order import TWINS, balanced_order, twin_leads
from colossal_hetero.bench.moe_prime import DESCRIPTION as PRIMING
from colossal_hetero.bench.moe_prime import minor_faults, primed, priming_summary, with_cpu
from colossal_hetero.moe.pipeline_choice import DECIDE_AFTER, TRIAL_STEPS

HF = {
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 128,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.02,
}
SEQ, PER_RANK, EP, EP4 = 64, 4, 2, 4
RATE_MBIT = {"dedicated": 300.0, "none": 900.0}
"""Link rate per emulation (``bench/moe_devices.py``), for a stock comm fraction of 0.40-0.60:
``dedicated`` 0.44-0.49 at 300 Mbit/s (0.31 at 900), ``none`` 0.40-0.44 at 900 (1200: 0.39)."""
CHUNK_KIB, MAX_INFLIGHT = 512, 2
UNLIMITED = 1024  # priority off: every ready chunk goes at once (plain bucketed overlap, DDP-like)
PIPELINE = 2  # token ranges of the forced a2a/expert pipelining (ours_pipe)
PIPELINE_MOST = 4  # all on: the cost model picks 1..this many ranges (moe.pipeline_auto)
VARIANTS = {  # name: (priority, fit_gaps, max_inflight, pipeline_chunks, pipeline_auto, packing)
    "ours_off": (False, False, UNLIMITED, 1, False, False),
    "ours_hold": (True, False, MAX_INFLIGHT, 1, False, False),
    "ours_on": (True, True, MAX_INFLIGHT, 1, False, False),
    "ours_pipe": (True, True, MAX_INFLIGHT, PIPELINE, False, False),
    "ours_pack": (True, True, MAX_INFLIGHT, 1, False, True),
    "ours_all": (True, False, MAX_INFLIGHT, PIPELINE_MOST, True, False),
    "ours_s7": (True, True, MAX_INFLIGHT, PIPELINE_MOST, True, False),
}
"""``ours_all`` ("all on"): priority (chunks held from dispatch to combine and during every
a2a: the issue's rule; gap fitting, ``ours_on``, measured 0.89-1.00x of it in every run of
sessions 8-9, docs/moe.md) and a2a/expert pipelining as its cost model chooses. Expert packing
(``ours_pack``) is left out: it does not combine with pipelining, and it runs level with
priority on (session 11).
Speed-aware placement is the even one on equal devices (its re-placement needs fp32: the
heterogeneous case measures it). ``ours_s7`` is all on as session 7 left it (``SESSION7``):
gap fitting, the optimizer stepped once after the whole flush, and the routing counts in an
a2a of their own (moe/split_step.py and moe/folded.py since)."""
SESSION7 = ("ours_s7",)
QUICK_SKIPS = SESSION7
"""Variants ``--quick`` leaves out (session 7's all on: a comparison kept for the full run)."""
EP4_VARIANTS = {"ours_all_ep4": "ours_all"}
"""Variants of ours at EP=4 (``EP4``) and the EP=2 x DP=2 variant whose settings each takes."""
WARMUP = DECIDE_AFTER + 1 + 2 * TRIAL_STEPS
"""Warm-up rounds: all on's pipelining choice (after step ``DECIDE_AFTER``) and its trial."""
BUDGET_S = {True: 110.0, False: 400.0}
"""Seconds of rounds (warm-up included) for ``--quick`` and the full run: each measured round
runs every variant twice (a priming step, then the timed one: bench/moe_prime.py)."""


def _model() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**HF))


def _build_stock(device: torch.device, ep: int = EP) -> tuple[Any, Any, Any]:
    from colossalai.booster import Booster
    from colossalai.booster.plugin import MoeHybridParallelPlugin

    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=ep, zero_stage=1, precision="bf16"
    )
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return booster, model, optimizer


def _build_ours(
    chunk_kib: int,
    priority: bool,
    fit: bool,
    max_inflight: int,
    pipeline: int,
    auto: bool,
    packing: bool,
    *,
    emulation: Any,
    stretch: str,
    ep: int = EP,
    sizing: tuple[float, float] | None = None,
) -> tuple[Any, Any, Any, Any]:
    from colossalai.booster import Booster

    from colossal_hetero.config.moe import MoeConfig
    from colossal_hetero.config.parallel import ParallelConfig
    from colossal_hetero.config.schema import HeteroConfig
    from colossal_hetero.plugin import HeteroParallelPlugin

    config = HeteroConfig(
        parallel=ParallelConfig(ep=ep, precision="bf16"),
        moe=MoeConfig(
            chunk_kib=chunk_kib,
            max_inflight=max_inflight,
            priority=priority,
            fit_gaps=fit,
            pipeline_chunks=pipeline,
            pipeline_auto=auto,
            packing=packing,
        ),
        emulation=emulation,
    )
    plugin = HeteroParallelPlugin(config)
    if stretch == "dedicated":  # each rank on a device of its own (bench/moe_devices.py)
        plugin.timer.stretch = "dedicated"
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    if sizing is not None:  # chunks of at most chunk_kib, sized over the phase runs
        from colossal_hetero.moe.wiring import MIN_CHUNK_BYTES

        for reducer in plugin.moe_reducers.values():
            reducer.size_over_runs(*sizing, MIN_CHUNK_BYTES)
    return booster, model, optimizer, plugin


def _a2a_medians(comm: Any) -> tuple[float, float, float]:
    """(forward, backward) median a2a transfer times of this step, and the fraction of the
    step's a2a calls with a gradient chunk of any rank on the wire. Collective (all ranks).

    A call's transfer time runs from the last rank's arrival to its end (max over ranks): an
    a2a cannot start before every peer calls it, so a rank's own call time also holds the
    peers' compute skew, which is not communication. ``perf_counter`` is one clock for every
    process of the machine. A step issues the same a2a's on every rank: the data calls (not
    the row counts) are the forward's dispatch and combine of each layer, then the
    backward's, so the first half is the forward (no gradient exists yet: alone) and the
    second the backward (gradient chunks are being reduced around them)."""
    calls = [e for e in comm.events if e.kind == "a2a" and e.nbytes > 64 and e.t_done]
    starts = torch.tensor([e.t_launch for e in calls], dtype=torch.float64)
    dist.all_reduce(starts, op=dist.ReduceOp.MAX)
    ends = torch.tensor([e.t_done for e in calls], dtype=torch.float64)
    dist.all_reduce(ends, op=dist.ReduceOp.MAX)
    chunks = [
        (c.t_launch, c.t_done if c.t_done is not None else c.t_launch)
        for reducer in comm.reducers.values()
        for c in reducer.events
        if c.kind == "chunk"
    ]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, chunks)
    wire = [c for rank_chunks in everyone for c in rank_chunks]
    return a2a_split(list(zip(starts.tolist(), ends.tolist(), strict=True)), wire)


def _a2a_bytes(log: list) -> float:
    """Bytes the world's ranks handed to the step's a2a calls (each rank's input tensors,
    local rows included; from the step logs). Collective (all ranks)."""
    mine = sum(row[5] for row in log if row[0] == "a2a")
    total = torch.tensor([float(mine)], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total.item())


def _packing_stats(model: Any) -> dict[str, int]:
    """This rank's packing accounting summed over its blocks (moe/packed.py): rows and bytes
    its tokens sent to other ranks, packed, and as the unpacked exchange would have sent."""
    from colossal_hetero.moe.block import HeteroEPMixtralSparseMoeBlock

    fields = ("rows_packed", "rows_unpacked", "bytes_packed", "bytes_unpacked")
    totals = dict.fromkeys(fields, 0)
    for block in model.modules():
        stats = getattr(block, "packing_stats", None)
        if isinstance(block, HeteroEPMixtralSparseMoeBlock) and stats is not None:
            for key in fields:
                totals[key] += int(getattr(stats, key))
    return totals


def a2a_split(
    spans: list[tuple[float, float]], wire: list[tuple[float, float]]
) -> tuple[float, float, float]:
    """(median of the first half's durations, of the second half's, fraction of ``spans``
    overlapping a ``wire`` interval) for a step's a2a spans (last arrival, end) in issue order
    and every rank's chunk intervals (pure)."""
    under = sum(any(a < e and s < b for a, b in wire) for s, e in spans)
    durations = [max(0.0, e - s) for s, e in spans]
    half = len(durations) // 2
    forward, backward = durations[:half], durations[half:]
    return (
        statistics.median(forward) if forward else 0.0,
        statistics.median(backward) if backward else 0.0,
        under / len(spans) if spans else 0.0,
    )


def moe_worker(
    rank: int, world_size: int, device: torch.device, *, quick: bool, stretch: str = "dedicated"
) -> dict:
    """One rank of the benchmark (module doc; ``WARMUP`` warm-ups: all on picks its
    pipelining), every variant on the devices ``stretch`` emulates (bench/moe_devices.py)."""
    from colossal_hetero.bench.moe_devices import emulated_devices
    from colossal_hetero.utils.quiet import quiet_third_party_warnings

    quiet_third_party_warnings()
    torch.set_num_threads(1)
    with emulated_devices(world_size, device, stretch) as devices:
        return _measure(rank, world_size, device, quick, devices)


def _measure(
    rank: int, world_size: int, device: torch.device, quick: bool, devices: Any
) -> dict[str, Any]:
    """``moe_worker``'s rounds on ``devices`` (``moe_devices.Devices``)."""
    from colossal_hetero.bench.moe_devices import scoped_step
    from colossal_hetero.bench.rounds import RoundsPolicy, rank0_decides, run_rounds

    emulation, stretch, clock = devices.emulation, devices.stretch, devices.clock
    counter, timer = devices.counter, devices.timer
    profiles = _profiles()
    chunk_kib = CHUNK_KIB  # the largest; each group's size is chosen over its phase runs
    # ours first: our plugin installs Colossal-AI's CPU fixes (compat/)
    skip = QUICK_SKIPS if quick else ()
    ours = _build_variants(chunk_kib, emulation, stretch, skip, sizing=profiles[0])
    logs: dict[str, list[tuple[float, list]]] = {name: [] for name in ours}
    stocks = {"stock": _build_stock(device), "stock_ep4": _build_stock(device, EP4)}
    batches = _Batches(rank, world_size)
    batch = batches.get

    def scope(index: int) -> AbstractContextManager[dict[str, float]]:
        return scoped_step(clock, counter, index)

    variants = {  # each measured round primed (bench/moe_prime.py)
        n: primed(_stock_variant(rank, b, batch, scope, timer), b[2], b[1].parameters)
        for n, b in stocks.items()
    }
    for n, b in ours.items():
        run = _ours_variant(b, batch, (counter, timer), logs[n])
        variants[n] = primed(run, b[2], b[1].parameters)
    ds_variants, ds_figures, ds_info = _deepspeed(batch, with_cpu(scope))
    policy = RoundsPolicy(warmup=WARMUP, min_rounds=8 if quick else 12, budget_s=BUDGET_S[quick])
    everything = {**variants, **ds_variants}
    order = balanced_order(list(everything), TWINS, WARMUP)  # bench/moe_order.py
    result = run_rounds(
        {name: everything[name] for name in order},
        {**_ratios(list(variants)), **ds_figures},
        policy,
        decide=rank0_decides(device),
    )
    timelines = {name: _median_step(steps) for name, steps in logs.items()}
    others = [b[1] for b in ours.values()] + [stocks["stock_ep4"][1]]
    loss_diff = _loss_check(stocks["stock"][1], others, batch, len(batches.drawn))
    for _, _, _, plugin in ours.values():
        plugin.close()
    return {
        "pipelining": _choice(ours["ours_all"]),
        "pipelining_ep4": _choice(ours["ours_all_ep4"]),
        "packing": _packing_stats(ours["ours_pack"][1]),
        "rounds": result.to_dict(),
        "twin_leads": twin_leads(order, TWINS, result.series, WARMUP),
        "priming": {"what": PRIMING, "medians": priming_summary(result.series)},
        "deepspeed": ds_info,
        "max_loss_diff_vs_stock": loss_diff,  # EP=4 included
        "timelines": timelines,
        "chunking": {
            "chunk_kib": chunk_kib,
            "profile_alpha_beta": {"dense": profiles[0], "expert": profiles[1]},
            "ours_on": _chunking(ours["ours_on"][3]),
        },
    }


def _choice(built: tuple) -> dict[str, Any] | None:
    """The pipelining choice of a variant of ours (its record; None without a chooser)."""
    return getattr(built[3].moe_log.comm.chooser, "record", None)


def _deepspeed(
    batch: Callable[[int], Any], scope: Callable[[int], Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """DeepSpeed-MoE at EP=2 x DP=2 and at EP=4 (bench/moe_deepspeed.py), when the optional
    extra is here: (variants, figures, info of the EP=2 one with ``ep4``'s inside)."""
    entries = {"deepspeed": (EP, "ours_all"), "deepspeed_ep4": (EP4, "ours_all_ep4")}
    variants: dict[str, Any] = {}
    figures: dict[str, Any] = {}
    infos = {}
    for name, (ep, all_on) in entries.items():
        run, figure, info = baseline_round_entries(
            _model, ep, "bf16", PER_RANK, batch, _agreed, all_on=all_on, scope=scope, name=name
        )
        engine = info.pop("engine", None)
        variants.update(  # primed, as every variant (bench/moe_prime.py)
            {n: primed(r, engine.optimizer, engine.module.parameters) for n, r in run.items()}
        )
        figures.update(figure)
        infos[name] = info
    return variants, figures, {**infos["deepspeed"], "ep4": infos["deepspeed_ep4"]}


def _ours_variant(
    built: tuple, batch: Callable[[int], Any], tools: tuple, logs: list[tuple[float, list]]
) -> Callable[..., dict[str, float]]:
    """One variant of ours as a round entry; measured steps' logs go to ``logs``; ``tools``:
    the process-group call counter and the collective timer."""
    counter, timer = tools

    def run(index: int, *, warmup: bool) -> dict[str, float]:
        booster, model, optimizer, plugin = built
        scope = counter.watching(plugin.timer)  # the seam opens and closes the step
        step_time, calls, seen = _train_step(booster, model, optimizer, batch(index), scope, timer)
        comm = sum(end - begin for begin, end, _ in calls)
        alone, under, overlapped = _a2a_medians(plugin.moe_log.comm)
        if not warmup:
            logs.append((step_time, [list(row) for row in plugin.moe_log.last]))
        s, c, pg, missed = _agreed([step_time, comm, seen["pg_calls"], seen["missed"]])
        a2a = {"a2a_alone": alone, "a2a_under": under, "a2a_overlapped": overlapped}
        counts = {"a2a_bytes": _a2a_bytes(plugin.moe_log.last), "pg_calls": pg}
        return {"step": s, "comm": c, **a2a, **counts, "missed": missed, **_phases(seen, plugin)}

    return run


def _build_variants(
    chunk_kib: int,
    emulation: Any,
    stretch: str,
    skip: tuple[str, ...],
    sizing: tuple[float, float] | None = None,
) -> dict[str, tuple[Any, Any, Any, Any]]:
    """Every variant of ours (``VARIANTS`` but ``skip``, then ``EP4_VARIANTS``); those of
    ``SESSION7`` without session 8's split optimizer step and folded routing counts;
    ``sizing``: the profile every variant's reducers size their chunks from (``_build_ours``)."""
    from colossal_hetero.moe.block import HeteroEPMixtralSparseMoeBlock

    ours = {
        name: _build_ours(chunk_kib, *setting, emulation=emulation, stretch=stretch, sizing=sizing)
        for name, setting in VARIANTS.items()
        if name not in skip
    }
    for name, like in EP4_VARIANTS.items():
        setting = VARIANTS[like]
        ours[name] = _build_ours(
            chunk_kib, *setting, emulation=emulation, stretch=stretch, ep=EP4, sizing=sizing
        )
    for name in set(SESSION7) & set(ours):
        ours[name][3].moe_log.comm.split_step = False
        for block in ours[name][1].modules():
            if isinstance(block, HeteroEPMixtralSparseMoeBlock):
                block.fold_counts = False
    return ours


def _stock_variant(
    rank: int,
    stock: tuple,
    batch: Callable[[int], Any],
    scope: Callable[[int], AbstractContextManager[dict[str, float]]],
    timer: CollectiveTimer,
) -> Callable[..., dict[str, float]]:
    """The stock plugin's round entry: its step, communication and transfer time, and its
    process-group calls (all and outside an intercepted collective), agreed."""
    from colossal_hetero.bench.shaped_spawn import report_bench_step

    def run(index: int, *, warmup: bool) -> dict[str, float]:
        report_bench_step(rank, index)
        booster, model, optimizer = stock
        step_time, calls, seen = _train_step(
            booster, model, optimizer, batch(index), scope(index), timer
        )
        comm, transfer = sum(end - begin for begin, end, _ in calls), transfer_time(calls)
        values = [step_time, comm, -1.0 if transfer is None else transfer]
        values += [seen["pg_calls"], seen["missed"], seen["cpu"], seen["faults"]]
        s, c, t, pg, missed, cpu, faults = _agreed(values)
        counts = {"pg_calls": pg, "missed": missed, "cpu": cpu, "faults": faults}
        return {"step": s, "comm": c, "transfer": t, **counts}

    return run


def _ratios(ran: list[str]) -> dict[str, Callable[[Mapping[str, float]], float]]:
    """The rounds' paired ratios (each > 1 when the second-named variant is faster) whose
    variants are among ``ran``."""
    ratios = {
        "ours_all_vs_stock": lambda v: v["stock.step"] / v["ours_all.step"],
        "all_vs_on": lambda v: v["ours_on.step"] / v["ours_all.step"],
        "all_vs_hold": lambda v: v["ours_hold.step"] / v["ours_all.step"],
        "pack_vs_on": lambda v: v["ours_on.step"] / v["ours_pack.step"],
        "pipe_vs_on": lambda v: v["ours_on.step"] / v["ours_pipe.step"],
        "ours_on_vs_stock": lambda v: v["stock.step"] / v["ours_on.step"],
        "ours_off_vs_stock": lambda v: v["stock.step"] / v["ours_off.step"],
        "ours_hold_vs_stock": lambda v: v["stock.step"] / v["ours_hold.step"],
        "on_vs_off": lambda v: v["ours_off.step"] / v["ours_on.step"],
        "on_vs_hold": lambda v: v["ours_hold.step"] / v["ours_on.step"],
        "all_vs_s7": lambda v: v["ours_s7.step"] / v["ours_all.step"],
        "ep4_all_vs_stock": lambda v: v["stock_ep4.step"] / v["ours_all_ep4.step"],
    }
    needs = {"all_vs_s7": "ours_s7"}
    return {name: f for name, f in ratios.items() if needs.get(name, "stock") in ran}


def _profiles() -> list[tuple[float, float]]:
    """The alpha-beta profiles (moe/profile.py, agreed over the world) of the world group and
    an expert group. Every variant of ours sizes both its gradient groups' chunks from the
    world group's (``ChunkedGradReducer.size_over_runs``: the size whose plan over the group's
    phase runs costs least, judged by the chunks that plan makes, 16 KiB to ``CHUNK_KIB``), so
    their chunks are the same; the expert group's is reported. Collective."""
    from colossal_hetero.moe.profile import profile_groups
    from colossal_hetero.moe.wiring import gradient_groups

    dense, expert = gradient_groups(dist.get_world_size(), EP)
    return profile_groups([dense, expert])


def _chunking(plugin: Any) -> dict[str, Any]:
    """Per gradient group: the profiled alpha (s) and beta (bytes/s) and the chunks' sizes."""
    return {
        name: {
            "alpha_s": reducer.profile[0] if reducer.profile else None,
            "beta_bytes_per_s": reducer.profile[1] if reducer.profile else None,
            "chunks": len(reducer.chunks),
            "max_chunk_bytes": max(c.numel * c.dtype.itemsize for c in reducer.chunks),
        }
        for name, reducer in plugin.moe_reducers.items()
    }


class _Batches:
    """Round ``index``'s global batch (the same for every variant), this rank's shard."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.generator = torch.Generator().manual_seed(1234)
        self.drawn: list[torch.Tensor] = []

    def get(self, index: int) -> torch.Tensor:
        while len(self.drawn) <= index:
            shape = (self.world_size * PER_RANK, SEQ)
            self.drawn.append(torch.randint(0, 256, shape, generator=self.generator))
        return self.drawn[index].split(PER_RANK)[self.rank]


def _train_step(
    booster: Any,
    model: Any,
    optimizer: Any,
    ids: torch.Tensor,
    scope: AbstractContextManager[dict[str, float]],
    timer: CollectiveTimer,
) -> tuple[float, list[Any], dict[str, float]]:
    """One step after a barrier: (wall seconds, the synchronous collectives' ``(start, end,
    ranks)``, what ``scope`` yielded); forward, backward and the optimizer step in ``scope``."""
    dist.barrier()
    start, cpu, faults = time.perf_counter(), time.thread_time(), minor_faults()
    with timer.recording() as calls:
        with scope as seen:
            loss = model(input_ids=ids, labels=ids).loss
            forward = time.perf_counter()
            booster.backward(loss, optimizer)
            backward = time.perf_counter()
            optimizer.step()
        optimizer.zero_grad()
    end = time.perf_counter()
    seen.update(cpu=time.thread_time() - cpu, fwd=forward - start, bwd=backward - forward)
    seen.update(opt=end - backward, faults=minor_faults() - faults)
    return end - start, calls, seen


PHASES = ("cpu", "faults", "fwd", "bwd", "opt", "stretch", "wait")


def _phases(seen: Mapping[str, float], plugin: Any) -> dict[str, float]:
    """Where a step of ours went, the slowest rank's of each (collective): the step thread's
    CPU seconds and minor page faults, the wall seconds of forward, backward and optimizer
    step (flush included), the emulated device's stretch and the collective waits."""
    timing = plugin.timer.last_timing
    values = [seen["cpu"], seen["faults"], seen["fwd"], seen["bwd"], seen["opt"]]
    values += [timing.stretch_time, timing.comm_wait]
    return dict(zip(PHASES, _agreed(values), strict=True))


def _agreed(values: list[float]) -> list[float]:
    """The maximum over ranks of each value (the slowest rank's), the same on every rank."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


def _median_step(steps: list[tuple[float, list]]) -> list:
    """The log of the step whose time is the (lower) median of this rank's measured steps."""
    ordered = sorted(steps, key=lambda item: item[0])
    return ordered[(len(ordered) - 1) // 2][1] if ordered else []


def _loss_check(
    stock: Any, others: list[Any], batch: Callable[[int], torch.Tensor], n: int
) -> float:
    """Largest |mean loss difference| between each of ``others`` (models) and ``stock`` on
    held batches after training the same rounds (forward only, no step); every variant saw
    the same batches."""
    diffs = []
    with torch.no_grad():
        for index in range(min(n, 4)):
            ids = batch(index)
            values = [float(stock(input_ids=ids, labels=ids).loss)]
            values += [float(model(input_ids=ids, labels=ids).loss) for model in others]
            tensor = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(tensor)
            tensor /= dist.get_world_size()
            diffs += [abs(float(tensor[i] - tensor[0])) for i in range(1, len(values))]
    return max(diffs)
