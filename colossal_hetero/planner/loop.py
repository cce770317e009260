"""HAP's loop: alternate the A* strategy search and the share LP until the step stops improving.

    shares <- proportional to speed
    repeat up to max_iters:
        program <- A*(shares)                 strategies, collectives, layouts at fixed shares
        shares' <- LP(program)                shares at a fixed program, within memory
        stop unless cost(program, shares') improves on the best so far
    round shares to integer widths and samples; one last A* at the rounded loads

Deterministic: no randomness, fixed expansion orders, and HiGHS is deterministic, so every rank
that plans from the same inputs gets the same plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from colossal_hetero.planner.cost import CostModel, Loads, Shares
from colossal_hetero.planner.plan import LayerPlan, Plan
from colossal_hetero.planner.search import (
    Problem,
    Program,
    Space,
    astar,
    program_cost,
    term_value,
)
from colossal_hetero.planner.shares import (
    IntegerShares,
    initial_shares,
    memory_error,
    optimize_shares,
    program_memory,
    round_shares,
    uniform_shares,
)
from colossal_hetero.planner.spec import (
    DEFAULT_GROUPED_EFFICIENCY,
    DEFAULT_LATENCY_S,
    REFERENCE_FLOPS,
    ClusterSpec,
    LayerKind,
    LayerSpec,
    Mesh,
    ModelSpec,
    ShardDim,
    Strategy,
)

_IMPROVEMENT = 1e-9
"""Relative improvement below which the loop stops (solver noise, not progress)."""


def _check_heads(model: ModelSpec, tp_size: int) -> None:
    """Every rank must hold at least one key/value head with its group of query heads."""
    for layer in model.layers:
        if not layer.num_heads or tp_size <= layer.num_heads:
            continue
        heads_dim = layer.in_shard if layer.kind is LayerKind.ATTENTION_OUT else layer.out_shard
        query = heads_dim.size // layer.head_dim if heads_dim and layer.head_dim else 0
        if query and query != layer.num_heads:
            raise ValueError(
                f"layer {layer.name}: tp_size {tp_size} exceeds its {layer.num_heads} key/value "
                f"heads ({query} attention heads in {layer.num_heads} groups; a rank holds "
                f"whole groups)"
            )
        raise ValueError(
            f"layer {layer.name}: tp_size {tp_size} exceeds its {layer.num_heads} attention "
            f"heads (a rank holds whole heads)"
        )


def align(model: ModelSpec, alignment: int) -> ModelSpec:
    """``model`` with every aligned shard dim's granularity a multiple of ``alignment``."""
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")

    def fix(dim: ShardDim | None) -> ShardDim | None:
        if dim is None or not dim.aligned:
            return dim
        return replace(dim, granularity=math.lcm(dim.granularity, alignment))

    layers = tuple(
        replace(la, in_shard=fix(la.in_shard), out_shard=fix(la.out_shard)) for la in model.layers
    )
    return replace(model, layers=layers)


def _check_minimum_memory(problem: Problem) -> None:
    """Each device must hold what no strategy splits (norms, position tables, row biases; the
    whole model without tensor parallelism), even with no samples to process."""
    cost = problem.cost
    n = cost.mesh.num_devices
    empty = Loads(np.zeros(n), np.zeros(n), np.zeros(n))
    need = np.zeros(n)
    for layer, choices in zip(cost.model.layers, problem.choices, strict=True):
        strategies = sorted({c.strategy for c in choices}, key=lambda s: s.value)
        need += np.min([np.asarray(cost.memory(layer, s, empty)) for s in strategies], axis=0)
    have = np.asarray(cost.cluster.memory_bytes)
    for d in np.flatnonzero(need > have):
        raise ValueError(
            f"device {d}: needs at least {need[d]:.4g} bytes ({need[d] / 2**30:.3f} GiB) for its "
            f"minimum shard (parameters no strategy splits, with gradients and optimizer "
            f"states), but has {have[d]:.4g} bytes ({have[d] / 2**30:.3f} GiB)"
        )


def _round_within_memory(problem: Problem, program: Program, shares) -> IntegerShares:
    """Round shares; devices that rounding pushes over memory round down instead."""
    cost = problem.cost
    mesh, model = cost.mesh, cost.model
    capacity = np.asarray(cost.cluster.memory_bytes)
    ints = round_shares(model, mesh, shares)
    over = np.flatnonzero(program_memory(problem, program, ints.loads(mesh)) > capacity)
    if over.size:
        try:
            ints = round_shares(
                model,
                mesh,
                shares,
                floor_ranks=frozenset(mesh.rank(int(d)) for d in over),
                floor_groups=frozenset(mesh.group(int(d)) for d in over),
            )
        except ValueError:
            raise memory_error(problem, program, shares) from None
        if np.any(program_memory(problem, program, ints.loads(mesh)) > capacity):
            raise memory_error(problem, program, shares)
    return ints


def search_plan(
    cluster: ClusterSpec,
    model: ModelSpec,
    *,
    tp_size: int | None = None,
    alignment: int = 1,
    max_iters: int = 10,
    space: str | Space = Space.FULL,
) -> Plan:
    """Plan ``model`` on ``cluster``: strategies, widths, batch shares and predicted times.

    Args:
        cluster: the devices, in rank order.
        model: the layers and batch.
        tp_size: tensor-parallel group size (default: all devices); must divide the devices.
        alignment: widths of non-head dimensions are multiples of this (e.g. 8 or 64).
        max_iters: bound on search/LP rounds.
        space: "full" (every strategy) or "megatron" (what the resizable layers execute).

    Raises:
        ValueError: naming the device or layer, when tp_size does not divide the devices or
            exceeds a layer's heads, or a device cannot hold its minimum shard, or no split of
            the model fits in memory.
    """
    if max_iters < 1:
        raise ValueError(f"max_iters must be >= 1, got {max_iters}")
    tp = cluster.num_devices if tp_size is None else tp_size
    mesh = Mesh.for_devices(cluster.num_devices, tp)
    _check_heads(model, tp)
    cost = CostModel(cluster, align(model, alignment), mesh)
    _check_minimum_memory(Problem(cost, Space.FULL))
    problem = Problem(cost, Space(space))
    candidates, rounds = _alternate(problem, initial_shares(cluster, mesh), max_iters)
    even = _even_candidate(cost)
    return _build_plan(_pick(candidates, even), rounds, even.rounded_cost)


@dataclass(frozen=True)
class _Candidate:
    """A program with its continuous shares, and (once rounded) its executable form."""

    problem: Problem
    program: Program
    shares: Shares
    value: float
    """Step time at the continuous shares."""
    ints: IntegerShares | None = None
    rounded_cost: float = np.inf
    """Step time at the rounded shares."""


def _alternate(problem: Problem, shares: Shares, max_iters: int) -> tuple[list[_Candidate], int]:
    """HAP's loop; returns every accepted (strictly improving) candidate and the rounds run."""
    cost = problem.cost
    mesh, batch = cost.mesh, cost.model.batch_size
    accepted: list[_Candidate] = []
    rounds = 0
    for _ in range(max_iters):
        program = astar(problem, Loads.continuous(mesh, batch, shares))
        new = optimize_shares(problem, program, shares)
        if new is None:
            if problem.space is Space.FULL and not accepted:
                # The memory-blind search picked replicated weights that cannot fit: fall back
                # to the stock strategies, which split every large weight.
                problem = Problem(cost, Space.MEGATRON)
                continue
            if not accepted:
                raise memory_error(problem, program, shares)
            break
        rounds += 1
        value = program_cost(problem, program.choices, Loads.continuous(mesh, batch, new))
        if accepted and value >= accepted[-1].value * (1 - _IMPROVEMENT):
            break
        accepted.append(_Candidate(problem, program, new, value))
        shares = new
    if not accepted:
        raise memory_error(problem, program, shares)
    return accepted, rounds


def _even_candidate(cost: CostModel) -> _Candidate:
    """Stock Colossal-AI: default strategies, every share even, the better collectives."""
    problem = Problem(cost, Space.MEGATRON)
    shares = uniform_shares(cost.mesh)
    ints = round_shares(cost.model, cost.mesh, shares)
    program = astar(problem, ints.loads(cost.mesh))
    return _Candidate(problem, program, shares, np.inf, ints, program.cost)


def _pick(candidates: list[_Candidate], even: _Candidate) -> _Candidate:
    """The candidate fastest after rounding, among the loop's, the best one re-searched at its
    rounded loads, and the even split (rounding can undo a small continuous gain)."""
    cost = even.problem.cost
    mesh, capacity = cost.mesh, np.asarray(cost.cluster.memory_bytes)

    def fits(cand: _Candidate) -> bool:
        assert cand.ints is not None
        return bool(
            np.all(program_memory(cand.problem, cand.program, cand.ints.loads(mesh)) <= capacity)
        )

    pool = []
    for cand in candidates:
        try:
            ints = _round_within_memory(cand.problem, cand.program, cand.shares)
        except ValueError:
            continue
        rounded = program_cost(cand.problem, cand.program.choices, ints.loads(mesh))
        pool.append(replace(cand, ints=ints, rounded_cost=rounded))
    if not pool:  # every rounding overflowed: report the loop's best
        best = candidates[-1]
        raise memory_error(best.problem, best.program, best.shares)
    best = pool[-1]  # the loop's best continuous value
    assert best.ints is not None
    polished = astar(best.problem, best.ints.loads(mesh))  # rounding may favour other choices
    pool += [
        c for c in (replace(best, program=polished, rounded_cost=polished.cost), even) if fits(c)
    ]
    # min keeps the first of equals, and the pool's order is fixed: deterministic everywhere.
    return min(pool, key=lambda c: c.rounded_cost)


def _build_plan(chosen: _Candidate, rounds: int, even_time: float) -> Plan:
    problem, program, shares, ints = chosen.problem, chosen.program, chosen.shares, chosen.ints
    assert ints is not None
    cost = problem.cost
    mesh, model = cost.mesh, cost.model
    loads = ints.loads(mesh)
    layers, busy = [], np.zeros(mesh.num_devices)
    for i, (layer, state, choice) in enumerate(
        zip(problem.layers, program.states, program.choices, strict=True)
    ):
        step = problem.edge_terms(i, state, choice, loads)
        assert step is not None
        for term in step[0]:
            busy += np.asarray(term.rows) if term.compute else term_value(term)
        io = cost.io(layer, choice.strategy)
        column_out = choice.strategy is Strategy.COLUMN and layer.kind not in (
            LayerKind.ATTENTION_CORE,
            LayerKind.LOSS,
        )
        layers.append(
            LayerPlan(
                name=layer.name,
                kind=layer.kind.value,
                strategy=choice.strategy.value,
                collective=choice.collective.value,
                grad_sync=choice.grad_sync.value if _has_own_params(layer) else "none",
                residual=None if choice.residual is None else choice.residual.value,
                input_layout=state.place.layout.value,
                split=None if io.split is None else ("out" if column_out else "in"),
                widths=None if io.split is None else ints.widths[io.split],
                time_s=sum(term_value(t) for t in step[0]),
                modules=layer.modules,
            )
        )
    step_time = program_cost(problem, program.choices, loads)
    return Plan(
        model=model.name,
        tp_size=mesh.tp_size,
        dp_size=mesh.dp_size,
        batch_size=model.batch_size,
        seq_len=model.seq_len,
        layers=tuple(layers),
        group_samples=ints.group_samples,
        batch_split=ints.batch_split,
        tp_ratios=tuple(float(r) for r in shares.tp),
        widths=_policy_widths(problem, program, ints),
        device_flops=tuple(cost.cluster.speeds),
        device_times=tuple(float(b) for b in busy),
        step_time=step_time,
        even_step_time=even_time,
        speedup=even_time / step_time if step_time > 0 else 1.0,
        iterations=rounds,
        space=problem.space.value,
    )


def _policy_widths(
    problem: Problem, program: Program, ints: IntegerShares
) -> dict[str, tuple[int, ...]]:
    """Widths of the split dims the resizable layers are configured by (heads, ffn, vocab)."""
    out: dict[str, tuple[int, ...]] = {}
    for layer, choice in zip(problem.layers, program.choices, strict=True):
        split = problem.cost.io(layer, choice.strategy).split
        if split is None:
            continue
        widths = ints.widths[split]
        if layer.kind is LayerKind.ATTENTION_QKV and choice.strategy is Strategy.COLUMN:
            out.setdefault("heads", tuple(w // layer.head_dim for w in widths))
        elif layer.kind is LayerKind.MLP_UP and choice.strategy is Strategy.COLUMN:
            out.setdefault("ffn", widths)
        elif (layer.kind, choice.strategy) in (
            (LayerKind.EMBEDDING, Strategy.ROW),
            (LayerKind.LM_HEAD, Strategy.COLUMN),
        ):
            out.setdefault("vocab", widths)
    return out


def _has_own_params(layer: LayerSpec) -> bool:
    weight = 0 if layer.tied else layer.weight_params
    return weight + layer.bias_params + layer.replicated_params > 0


_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def plan_for_run(
    run_config: Any,
    world_size: int,
    *,
    reference_flops: float = REFERENCE_FLOPS,
    latency_s: float = DEFAULT_LATENCY_S,
    grouped_efficiency: float = DEFAULT_GROUPED_EFFICIENCY,
    alignment: int = 1,
    max_iters: int = 10,
    space: str | Space | None = None,
    layer_overhead_s: float = 0.0,
) -> Plan:
    """Plan a ``config.schema.RunConfig`` on ``world_size`` ranks.

    Uses ``cluster.devices`` (speed relative to ``reference_flops``, memory, bandwidth; the
    link model's ``latency_s`` and ``grouped_efficiency`` come from the arguments), the
    model from ``model`` (read as ``plan.model_spec`` says: "hf" from the transformers config
    of ``colossal_hetero.models.build_hf_config``, "fx" from a torch.fx trace of
    ``build_model`` on the meta device; both import transformers), ``data.global_batch_size``
    and ``data.seq_len``, ``parallel.tp`` and ``parallel.precision``. ``space`` defaults to
    the one the plugin executes for the layout (``Space.executed``).

    Raises:
        NotImplementedError: for pipeline parallelism (pp > 1).
        ConfigError: naming ``plan.model_spec`` when the fx trace cannot be read as layers.
        ValueError: as :func:`search_plan`, or for a layout that does not fill the world.
    """
    parallel = run_config.parallel
    if parallel.pp > 1:
        raise NotImplementedError("the planner does not plan pipeline stages yet (pp > 1)")
    if world_size % parallel.tp or (parallel.dp and parallel.tp * parallel.dp != world_size):
        raise ValueError(
            f"parallel: tp {parallel.tp} x dp {parallel.dp or 'auto'} does not fill the world "
            f"size {world_size}"
        )
    cluster = ClusterSpec.from_config(
        run_config.cluster,
        world_size,
        reference_flops=reference_flops,
        latency_s=latency_s,
        grouped_efficiency=grouped_efficiency,
        layer_overhead_s=layer_overhead_s,
    )
    model = _run_model_spec(run_config, _DTYPE_BYTES[parallel.precision])
    if space is None:
        space = Space.executed(tp=parallel.tp, pp=parallel.pp, zero_stage=parallel.zero_stage)
    return search_plan(
        cluster, model, tp_size=parallel.tp, alignment=alignment, max_iters=max_iters, space=space
    )


def _run_model_spec(run_config: Any, dtype_bytes: int) -> ModelSpec:
    """The configured model's spec, from its transformers config or from an fx trace."""
    from colossal_hetero.config.loader import ConfigError
    from colossal_hetero.models import build_hf_config

    batch_size, seq_len = run_config.data.global_batch_size, run_config.data.seq_len
    if run_config.plan.model_spec == "hf":
        from colossal_hetero.planner.hf import model_spec_from_hf

        hf_config = build_hf_config(run_config.model)
        return model_spec_from_hf(hf_config, batch_size, seq_len, dtype_bytes=dtype_bytes)
    import torch

    from colossal_hetero.models import build_model
    from colossal_hetero.planner.fx import model_spec_from_fx

    with torch.device("meta"):  # the trace reads shapes only: allocate no weights
        model = build_model(run_config.model)
    try:
        return model_spec_from_fx(model, batch_size, seq_len, dtype_bytes=dtype_bytes)
    except ValueError as error:
        raise ConfigError(f"plan.model_spec: fx: {error}") from None
