"""``bench dynamic``: build the variants of one spawned world and run them interleaved.

Shared by the throughput run (dynamic_run.py) and the accuracy run (dynamic_digits.py).
Variants are stock Colossal-AI runners (``HybridParallelPlugin`` with an interceptor of the
given emulation) and ``HeteroParallelPlugin`` runners (their config's emulation and
balancer); at most one of the latter is the oracle, moved to each phase's planned widths at
the step the phase begins. Round ``i`` of ``bench.rounds`` is training step ``i`` of every
variant, on the same batch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from colossal_hetero.bench.dynamic_phases import Phase
from colossal_hetero.config.schema import EmulationConfig, HeteroConfig, ModelConfig


@dataclass(frozen=True)
class World:
    """What every variant of one world shares."""

    model: ModelConfig
    phases: tuple[Phase, ...]
    warmup: int
    batch_size: int
    seq_len: int
    train_batch: Callable[[int], dict[str, torch.Tensor]]
    """Step -> the global batch of that step (the same for every variant)."""
    val_batches: Sequence[dict[str, torch.Tensor]]
    eval_every: int = 0
    """Also evaluate every this many steps (0: only at the end of each phase)."""
    lr: float = 1e-3
    """AdamW learning rate of every variant (the runner's default is 1e-3)."""
    lr_at: Callable[[int], float] | None = None
    """Step -> learning rate of that step for every variant (a schedule); None: ``lr``."""
    stretch: Literal["added", "dedicated"] = "added"
    """How every variant's interceptor lengthens a slowed rank's compute (``added`` or
    ``dedicated``, see ``CollectiveInterceptor``)."""
    cluster: EmulationConfig | None = None
    """The emulated cluster every slowed variant rehearses, where stock variants slow ranks
    by schedules of their own on it (the unperturbed one: the devices without the straggler
    events). Their interceptors carry it as their ``emulation``, the whole-world config the
    router compares, so that they may share the process. None: each its own."""

    @property
    def steps(self) -> int:
        return self.phases[-1].end


def run_variants(
    world: World,
    stock: Mapping[str, EmulationConfig],
    hetero: Mapping[str, HeteroConfig],
    device: torch.device,
    *,
    oracle: str | None = None,
) -> dict[str, Any]:
    """Build every variant, run the rounds, evaluate, close; returns (the same on every rank)
    ``{"rounds", "variants": {name: {"rows", "bytes", "evals", "records", "widths",
    "op_bytes"}}, "oracle_widths"}``.

    ``rows``: every step's all-gathered ``[step, compute, wait, loss] * ranks``; ``bytes``:
    bytes sent per step summed over ranks (the interceptor's count of every collective and
    point-to-point call); ``evals``: ``[step, loss, accuracy]`` at each phase end;
    ``records``: the balancer's decision records (agreed, so rank 0's stand for all);
    ``op_bytes``: what in-layer ops' own counters (``bytes_sent``) hold at the end;
    ``agree_s``: the seconds of each balancer agreement on rank 0 (empty without one);
    ``agree_last_s``: per agreement, the least seconds any rank spent in it (the last rank to
    arrive waits for the gather alone: its time is what the agreement adds to a step).
    """
    started = time.perf_counter()
    runners, plugins = _build(world, stock, hetero, device)
    for runner in runners.values():  # before the first step, so every variant starts alike
        for group in runner.optimizer.param_groups:
            group["lr"] = world.lr
    seconds = {"build": time.perf_counter() - started}
    sent: dict[str, list[float]] = {name: [] for name in runners}
    evals: dict[str, list[list[Any]]] = {name: [] for name in runners}
    oracle_widths = _oracle_widths(world, hetero, plugins, runners, oracle)
    stepper = _Stepper(world, runners, plugins, device, oracle, oracle_widths, sent, evals)
    started = time.perf_counter()
    try:
        rounds = _run_rounds(world, stepper, device)
        out = {
            name: {
                "rows": runner.rows,
                "bytes": _sum_over_ranks(sent[name], device),
                "evals": evals[name],
                "records": _records(plugins.get(name)),
                "widths": _widths(plugins.get(name)),
                "op_bytes": _sum_over_ranks([_op_bytes(runner.model)], device)[0],
                "agree_s": _agree_seconds(plugins.get(name)),
                "agree_last_s": _min_over_ranks(_agree_seconds(plugins.get(name)), device),
            }
            for name, runner in runners.items()
        }
    finally:
        for runner in runners.values():
            runner.close()
        for plugin in plugins.values():
            plugin.close()
    seconds["rounds"] = time.perf_counter() - started
    return {
        "rounds": rounds.to_dict(),
        "variants": out,
        "oracle_widths": oracle_widths,
        "seconds": seconds,
    }


def _run_rounds(world: World, stepper: _Stepper, device: torch.device) -> Any:
    """Every step of the schedule as one round of every variant (no early stop)."""
    from colossal_hetero.bench.rounds import RoundsPolicy, rank0_decides, run_rounds

    rounds_n = world.steps - world.warmup
    policy = RoundsPolicy(
        warmup=world.warmup, min_rounds=rounds_n, max_rounds=rounds_n, budget_s=1e9
    )
    variants = {name: stepper.variant(name) for name in stepper.runners}
    return run_rounds(variants, {}, policy, decide=rank0_decides(device))


@dataclass
class _Stepper:
    """One training step of a named variant, as ``bench.rounds`` calls it: the oracle's
    move at a phase start, the step, its bytes, and an evaluation at phase ends."""

    world: World
    runners: Mapping[str, Any]
    plugins: Mapping[str, Any]
    device: torch.device
    oracle: str | None
    oracle_widths: Sequence[dict[str, list[int]]]
    sent: dict[str, list[float]]
    evals: dict[str, list[list[Any]]]

    def __post_init__(self) -> None:
        world = self.world
        self.val = [{k: v.to(self.device) for k, v in b.items()} for b in world.val_batches]
        self.ends = {p.end for p in world.phases}
        if world.eval_every:
            self.ends |= set(range(world.eval_every, world.steps + 1, world.eval_every))

    def variant(self, name: str) -> Callable[..., dict[str, float] | None]:
        def step(index: int, *, warmup: bool) -> dict[str, float] | None:
            return self.step(name, index, warmup=warmup)

        return step

    def step(self, name: str, index: int, *, warmup: bool) -> dict[str, float] | None:
        runner, world = self.runners[name], self.world
        if name == self.oracle:
            _oracle_move(index, world.phases, self.oracle_widths, self.plugins[name], runner)
        if world.lr_at is not None:
            for group in runner.optimizer.param_groups:
                group["lr"] = world.lr_at(index)
        runner.step(index, record=True, batch=world.train_batch(index))
        timing = runner.seam.last_timing
        self.sent[name].append(float(sum(timing.bytes_by_kind.values())) if timing else 0.0)
        if index + 1 in self.ends:
            self.evals[name].append([index + 1, *_evaluate(runner, self.val, self.device)])
        if warmup:
            return None
        row, ranks = runner.rows[-1], len(runner.rows[-1]) // 4
        return {"step": max(row[0::4]), "compute": sum(row[1::4]) / ranks}


def _build(
    world: World,
    stock: Mapping[str, EmulationConfig],
    hetero: Mapping[str, HeteroConfig],
    device: torch.device,
) -> tuple[dict[str, Any], dict[str, Any]]:
    from colossalai.booster.plugin import HybridParallelPlugin

    from colossal_hetero.bench.measure import TrainingRunner
    from colossal_hetero.config.schema import ClusterConfig, ParallelConfig
    from colossal_hetero.emulation import build_interceptor
    from colossal_hetero.plugin import HeteroParallelPlugin
    from colossal_hetero.plugin.engine import engine_kwargs

    rank, size = dist.get_rank(), dist.get_world_size()
    shape: dict[str, Any] = {
        "batch_size": world.batch_size,
        "seq_len": world.seq_len,
        "device": device,
    }
    from colossal_hetero.utils.device import device_kind

    kind = device_kind(device)
    plain = HeteroConfig(parallel=ParallelConfig(tp=size), cluster=ClusterConfig(device=kind))
    runners: dict[str, Any] = {}
    plugins: dict[str, Any] = {}
    for name, emulation in stock.items():
        timer = build_interceptor(emulation, rank, size, device)
        timer.stretch = world.stretch
        if world.cluster is not None and emulation.enabled:
            timer.emulation = world.cluster
        runners[name] = TrainingRunner(
            world.model,
            HybridParallelPlugin(**engine_kwargs(plain, device)),
            timer,
            emulated=emulation.enabled,
            **shape,
        )
    for name, config in hetero.items():
        plugins[name] = HeteroParallelPlugin(
            config, workload=(world.batch_size, world.seq_len), policy=_even_policy(world, config)
        )
        plugins[name].timer.stretch = world.stretch
        runners[name] = TrainingRunner(world.model, plugins[name], **shape)
    return runners, plugins


def _even_policy(world: World, config: HeteroConfig) -> Any:
    """Our resizable layers at even widths for a variant that would otherwise get the stock
    shardformer policy (no plan, no balancer that resizes), so that every variant of ours
    computes with the same layers (and a 10-class ViT head is not split over 4 ranks)."""
    from colossal_hetero.balance.checks import needs_resizable
    from colossal_hetero.models import build_model
    from colossal_hetero.planner.resolve import wants_plan
    from colossal_hetero.policies import resizable_policy

    if wants_plan(config) or needs_resizable(config):
        return None
    return resizable_policy(build_model(world.model), {})


def _oracle_widths(
    world: World,
    hetero: Mapping[str, HeteroConfig],
    plugins: Mapping[str, Any],
    runners: Mapping[str, Any],
    oracle: str | None,
) -> list[dict[str, list[int]]]:
    """The planner's widths at each phase's true speeds (the oracle's), phase by phase."""
    if oracle is None:
        return []
    from colossal_hetero.balance.replan import plan_widths

    hf_model = runners[oracle].model.unwrap()
    size = dist.get_world_size()
    workload = (world.batch_size, world.seq_len)
    return [
        {
            k: list(v)
            for k, v in plan_widths(hetero[oracle], hf_model, size, workload, p.speeds).items()
        }
        for p in world.phases
    ]


def _oracle_move(
    step: int,
    phases: Sequence[Phase],
    widths: Sequence[dict[str, list[int]]],
    plugin: Any,
    runner: Any,
) -> None:
    """At the first step of a phase after the first, move to that phase's plan (between
    steps, so the move is not in any step's time; it is a one-off the oracle gets free)."""
    for index, phase in enumerate(phases):
        if index and step == phase.start and widths[index] != widths[index - 1]:
            plugin.resize(runner.model, runner.optimizer, widths[index])


def _evaluate(
    runner: Any, batches: Sequence[dict[str, torch.Tensor]], device: torch.device
) -> list[Any]:
    """``[loss, accuracy or None]`` on the validation batches (forward only, every rank)."""
    from colossal_hetero.training.steps import evaluate

    result = evaluate(
        runner.booster,
        runner.model,
        runner.criterion,
        list(batches),
        use_pipeline=False,
        device=device,
    )
    return [result.loss, result.accuracy]


def _sum_over_ranks(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return [float(v) for v in tensor.tolist()]


def _min_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Elementwise minimum over ranks (every rank holds as many values: agreements follow the
    step number alone); no collective when there are none (then none anywhere)."""
    if not values:
        return []
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return [float(v) for v in tensor.tolist()]


def _op_bytes(model: Any) -> float:
    """Bytes the in-layer ops attached now report having sent (their ``bytes_sent``)."""
    total = 0.0
    for module in model.modules():
        op = getattr(module, "local_op", None)
        total += float(getattr(op, "bytes_sent", 0.0) or 0.0)
    return total


def _records(plugin: Any) -> list[dict[str, Any]]:
    controller = getattr(plugin, "balancer", None) if plugin is not None else None
    log = getattr(controller, "log", None)
    return list(getattr(log, "records", []))


def _agree_seconds(plugin: Any) -> list[float]:
    """This rank's seconds in each of its balancer's agreements (its all_gather)."""
    controller = getattr(plugin, "balancer", None) if plugin is not None else None
    return list(getattr(controller, "agree_s", []))


def _widths(plugin: Any) -> dict[str, list[int]] | None:
    if plugin is None:
        return None
    widths = getattr(plugin.engine.custom_policy, "widths", None) or {}
    return {k: list(v) for k, v in widths.items()} or None


def median_step(rows: Sequence[Sequence[float]]) -> float:
    """Median over ``rows`` of the slowest rank's step time."""
    return statistics.median(max(row[0::4]) for row in rows)
