"""SFB in the executable space megatron_sfb: chosen exactly where its modelled cost is lower.

Sufficient factor broadcasting gathers every device's tokens * (in + out) factors instead of
all-reducing in * out gradients, so it should win with few tokens and wide layers and lose
with many tokens. The runtime executes it only without tensor parallelism and with torch DDP,
so megatron_sfb offers it only at tp 1, and megatron (stock, every layout) never does.
"""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest

from colossal_hetero.planner import ClusterSpec, model_spec_from_hf, search_plan
from colossal_hetero.planner.cost import Collective, CostModel, GradSync, Loads, Shares
from colossal_hetero.planner.search import (
    Choice,
    Problem,
    Space,
    astar,
    brute_force,
    program_cost,
)
from colossal_hetero.planner.spec import LayerKind, LayerSpec, Mesh, ModelSpec, Strategy
from tests.tolerances import FLOAT64_FORMULA_RTOL
from tests.unit.planner_layers import linear, loss, norm


def _classifier(tokens: int) -> list[LayerSpec]:
    return [
        linear("fc1", LayerKind.LINEAR, 512, 512, tokens),
        norm("ln", 512, tokens),
        linear("fc2", LayerKind.LINEAR, 512, 256, tokens),
        loss(256, tokens),
    ]


def _problem(layers, speeds, tp, *, batch, space=Space.MEGATRON_SFB, bandwidth=1.0):
    model = ModelSpec(name="toy", layers=tuple(layers), batch_size=batch, seq_len=layers[0].tokens)
    cluster = ClusterSpec.from_relative(
        speeds, reference_flops=1e12, bandwidth_gbps=bandwidth, memory_gib=1.0
    )
    mesh = Mesh.for_devices(len(speeds), tp)
    return Problem(CostModel(cluster, model, mesh), space), mesh


def _loads(mesh: Mesh, batch: int, groups) -> Loads:
    return Loads.continuous(mesh, batch, Shares((1.0,), (1.0,), tuple(groups)))


def _own_cost(problem: Problem, index: int, sync: GradSync, loads: Loads) -> float:
    terms, _ = problem.cost.layer_terms(
        problem.layers[index], Strategy.REPLICATE, sync, Collective.PADDED, loads
    )
    return sum(float(np.max(t.rows)) for t in terms)


@pytest.mark.parametrize(("tokens", "expect_sfb"), [(1, True), (512, False)])
def test_sfb_chosen_when_tokens_are_few_and_not_when_many(tokens, expect_sfb):
    problem, mesh = _problem(_classifier(tokens), [1.0, 0.5, 1.0, 0.25], 1, batch=4)
    loads = _loads(mesh, 4, (0.4, 0.2, 0.3, 0.1))
    program = astar(problem, loads)
    for i, (layer, choice) in enumerate(zip(problem.layers, program.choices, strict=True)):
        if layer.kind is not LayerKind.LINEAR:
            assert choice.grad_sync is GradSync.ALLREDUCE
            continue
        # The search picks SFB exactly where the layer's own modelled cost is lower.
        sfb = _own_cost(problem, i, GradSync.SFB, loads)
        allreduce = _own_cost(problem, i, GradSync.ALLREDUCE, loads)
        assert (choice.grad_sync is GradSync.SFB) == (sfb < allreduce), (layer.name, sfb, allreduce)
        assert (choice.grad_sync is GradSync.SFB) == expect_sfb, layer.name


def test_sfb_offered_only_where_the_runtime_runs_it():
    layers = _classifier(1)
    offered, _ = _problem(layers, [1.0, 1.0], 1, batch=2)
    assert GradSync.SFB in {c.grad_sync for c in offered.choices[0]}
    # Grouped factor gathers run too; a grouped choice without SFB is never valid.
    assert {c.collective for c in offered.choices[0]} == {Collective.PADDED, Collective.GROUPED}
    without, _ = _problem(layers, [1.0, 1.0], 1, batch=2, space=Space.MEGATRON)
    tensor_parallel, _ = _problem(layers, [1.0, 1.0, 1.0, 1.0], 2, batch=2)
    single, _ = _problem(layers, [1.0], 1, batch=2)  # no data parallelism: nothing to sync
    for problem in (without, tensor_parallel, single):
        assert all(c.grad_sync is GradSync.ALLREDUCE for cs in problem.choices for c in cs)


@pytest.mark.parametrize("tokens", [1, 4, 16])
@pytest.mark.parametrize("num_devices", [2, 3])
def test_astar_equals_brute_force_with_sfb(tokens, num_devices):
    rng = np.random.default_rng(tokens * 10 + num_devices)
    speeds = list(rng.uniform(0.25, 1.0, num_devices))
    problem, mesh = _problem(_classifier(tokens), speeds, 1, batch=8)
    shares = rng.uniform(0.2, 1.0, num_devices)
    loads = _loads(mesh, 8, shares / shares.sum())
    found, exact = astar(problem, loads), brute_force(problem, loads)
    # float64 sums of the same costs in another order (<= ~100 terms): ~1e-14 apart
    assert found.cost == pytest.approx(exact.cost, rel=1e-12, abs=1e-15)
    assert program_cost(problem, found.choices, loads) == pytest.approx(found.cost, rel=1e-12)
    # Brute force over every SFB/all-reduce combination of the two linears, by hand.
    linears = [i for i, la in enumerate(problem.layers) if la.kind is LayerKind.LINEAR]
    best = np.inf
    for syncs in itertools.product(GradSync, repeat=len(linears)):
        choices = list(found.choices)
        for i, sync in zip(linears, syncs, strict=True):
            choices[i] = Choice(Strategy.REPLICATE, grad_sync=sync)
        best = min(best, program_cost(problem, tuple(choices), loads))
    assert found.cost == pytest.approx(best, rel=1e-12)  # as above: float64, other order


def test_grouped_factor_gathers_chosen_when_shares_are_very_uneven():
    problem, mesh = _problem(_classifier(1), [1.0] * 4, 1, batch=64)
    loads = _loads(mesh, 64, (0.85, 0.05, 0.05, 0.05))
    sfb = [c for c in astar(problem, loads).choices if c.grad_sync is GradSync.SFB]
    assert sfb and all(c.collective is Collective.GROUPED for c in sfb)
    even = astar(problem, _loads(mesh, 64, (0.25,) * 4)).choices
    assert all(c.collective is Collective.PADDED for c in even)
    assert {c.grad_sync for c in even} == {GradSync.SFB, GradSync.ALLREDUCE}


def test_factor_gather_counts_each_modules_input():
    """q, k and v each gather the layer's input: three inputs plus the fused output."""
    fused = linear("qkv", LayerKind.LINEAR, 64, 192, 4, modules=("q", "k", "v"))
    single = linear("qkv", LayerKind.LINEAR, 64, 192, 4, modules=("qkv",))
    values = []
    for layer in (fused, single):
        problem, mesh = _problem([layer, loss(192, 4)], [1.0, 1.0], 1, batch=2)
        terms, _ = problem.cost.layer_terms(
            layer, Strategy.REPLICATE, GradSync.SFB, Collective.PADDED, _loads(mesh, 2, (0.5,) * 2)
        )
        values.append(next(float(np.max(t.rows)) for t in terms if t.label == "factor all-gather"))
    latency = problem.cost.cluster.latency_s
    ratio = (values[0] - latency) / (values[1] - latency)
    assert ratio == pytest.approx((3 * 64 + 192) / (64 + 192), rel=FLOAT64_FORMULA_RTOL)


def _gpt2():
    return types.SimpleNamespace(
        model_type="gpt2",
        n_embd=32,
        n_head=4,
        n_layer=2,
        n_inner=None,
        vocab_size=256,
        n_positions=32,
        tie_word_embeddings=True,
    )


@pytest.mark.parametrize(("batch", "seq", "expect_sfb"), [(4, 4, True), (64, 32, False)])
def test_search_plan_records_sfb_layers_with_their_modules(batch, seq, expect_sfb):
    spec = model_spec_from_hf(_gpt2(), batch_size=batch, seq_len=seq, dtype_bytes=4)
    cluster = ClusterSpec.from_relative([1.0, 0.5], reference_flops=1e9, bandwidth_gbps=0.1)
    plan = search_plan(cluster, spec, tp_size=1, space="megatron_sfb")
    sfb = [layer for layer in plan.layers if layer.grad_sync == "sfb"]
    assert bool(sfb) == expect_sfb
    assert all(layer.modules == (layer.name,) and layer.kind != "lm_head" for layer in sfb)
    allreduce = search_plan(cluster, spec, tp_size=1, space="megatron")
    assert all(layer.grad_sync != "sfb" for layer in allreduce.layers)
    if expect_sfb:
        assert plan.step_time < allreduce.step_time
