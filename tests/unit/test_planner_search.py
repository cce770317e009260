"""A* over per-layer strategies equals brute force on small graphs; programs are valid."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from colossal_hetero.planner.cost import Collective, CostModel, GradSync, Layout, Loads, Shares
from colossal_hetero.planner.search import (
    Choice,
    Problem,
    Space,
    astar,
    brute_force,
    program_cost,
)
from colossal_hetero.planner.spec import (
    ClusterSpec,
    LayerKind,
    LayerSpec,
    Mesh,
    ModelSpec,
    ShardDim,
    Strategy,
)
from tests.unit.planner_layers import embedding, linear, loss, norm


def _graphs() -> dict[str, list[LayerSpec]]:
    h = 96
    head = 4
    core = LayerSpec(
        name="core",
        kind=LayerKind.ATTENTION_CORE,
        tokens=16,
        in_features=3 * h,
        out_features=h,
        flops_per_token=4.0 * 16 * h,
        in_shard=ShardDim(h, h // head, aligned=False),
        out_shard=ShardDim(h, h // head, aligned=False),
        num_heads=head,
        saves_output=True,
        default=Strategy.COLUMN,
    )
    qkv = linear("qkv", LayerKind.ATTENTION_QKV, h, 3 * h, heads=head, default=Strategy.COLUMN)
    qkv = LayerSpec(**{**{f: getattr(qkv, f) for f in qkv.__slots__}, "out_shard": core.in_shard})
    out = linear(
        "out", LayerKind.ATTENTION_OUT, h, h, heads=head, default=Strategy.ROW, closes_residual=True
    )
    out = LayerSpec(**{**{f: getattr(out, f) for f in out.__slots__}, "in_shard": core.out_shard})
    return {
        "mlp": [
            linear("up", LayerKind.MLP_UP, h, 4 * h, default=Strategy.COLUMN),
            linear("down", LayerKind.MLP_DOWN, 4 * h, h, default=Strategy.ROW),
            loss(h),
        ],
        "residual_block": [
            norm("ln", h, opens_residual=True),
            linear("up", LayerKind.MLP_UP, h, 4 * h, default=Strategy.COLUMN),
            linear(
                "down", LayerKind.MLP_DOWN, 4 * h, h, default=Strategy.ROW, closes_residual=True
            ),
            loss(h),
        ],
        "attention": [embedding(500, h), norm("ln", h, opens_residual=True), qkv, core, out],
        "tied_head": [
            embedding(1000, h),
            norm("ln_f", h),
            linear("head", LayerKind.LM_HEAD, h, 1000, tied=True, default=Strategy.COLUMN),
            loss(1000),
        ],
        "classifier_sfb": [  # few tokens and wide layers: factor broadcasting can pay
            linear("fc1", LayerKind.LINEAR, 512, 512, tokens=1),
            linear("fc2", LayerKind.LINEAR, 512, 512, tokens=1),
            loss(512, tokens=1),
        ],
    }


def _problem(layers, speeds, tp, *, batch=8, bandwidth=25.0, space=Space.FULL):
    model = ModelSpec(name="toy", layers=tuple(layers), batch_size=batch, seq_len=16)
    cluster = ClusterSpec.from_relative(
        speeds, reference_flops=1e12, bandwidth_gbps=bandwidth, memory_gib=1.0
    )
    mesh = Mesh.for_devices(len(speeds), tp)
    return Problem(CostModel(cluster, model, mesh), space), mesh


def _random_shares(rng, mesh: Mesh) -> Shares:
    def simplex(n):
        x = rng.uniform(0.2, 1.0, n)
        return tuple(x / x.sum())

    return Shares(simplex(mesh.tp_size), simplex(mesh.tp_size), simplex(mesh.dp_size))


@pytest.mark.parametrize("graph", list(_graphs()))
@pytest.mark.parametrize(("num_devices", "tp"), [(2, 2), (3, 3), (4, 2)])
def test_astar_equals_brute_force(graph, num_devices, tp):
    rng = np.random.default_rng(zlib.crc32(f"{graph}/{num_devices}/{tp}".encode()))
    layers = _graphs()[graph]
    speeds = list(rng.uniform(0.25, 1.0, num_devices))
    for bandwidth in (1.0, 200.0):  # communication-bound and compute-bound
        problem, mesh = _problem(layers, speeds, tp, bandwidth=bandwidth)
        loads = Loads.continuous(mesh, 8, _random_shares(rng, mesh))
        found, exact = astar(problem, loads), brute_force(problem, loads)
        # float64 sums of the same costs in another order (<= ~100 terms): ~1e-14 apart
        assert found.cost == pytest.approx(exact.cost, rel=1e-12, abs=1e-15)
        assert program_cost(problem, found.choices, loads) == pytest.approx(found.cost, rel=1e-12)
        assert problem.replay(found.choices) == found.states


def test_sfb_chosen_when_it_pays_and_grouped_when_padding_wastes():
    layers = _graphs()["classifier_sfb"]
    problem, mesh = _problem(layers, [1.0] * 4, 1, batch=4, bandwidth=1.0)
    loads = Loads.continuous(mesh, 4, Shares((1.0,), (1.0,), (0.25,) * 4))
    program = astar(problem, loads)
    assert program.choices[0].grad_sync is GradSync.SFB
    # Very uneven batch shares: grouped factor gathers beat padding every shard to the largest.
    loads = Loads.continuous(mesh, 64, Shares((1.0,), (1.0,), (0.85, 0.05, 0.05, 0.05)))
    problem, _ = _problem(layers, [1.0] * 4, 1, batch=64, bandwidth=1.0)
    sfb = [c for c in astar(problem, loads).choices if c.grad_sync is GradSync.SFB]
    assert sfb and all(c.collective is Collective.GROUPED for c in sfb)


def test_full_space_is_never_worse_than_megatron_or_replicated():
    layers = _graphs()["residual_block"]
    rng = np.random.default_rng(5)
    speeds = [1.0, 0.5, 0.25, 1.0]
    problem, mesh = _problem(layers, speeds, 4)
    megatron, _ = _problem(layers, speeds, 4, space=Space.MEGATRON)
    loads = Loads.continuous(mesh, 8, _random_shares(rng, mesh))
    best = astar(problem, loads)
    assert best.cost <= astar(megatron, loads).cost + 1e-15
    replicated = tuple(
        Choice(Strategy.REPLICATE, residual=Layout.R if la.opens_residual else None)
        for la in layers
    )
    assert best.cost <= program_cost(problem, replicated, loads) + 1e-15


def test_megatron_space_keeps_default_strategies_and_tied_head_follows_embedding():
    layers = _graphs()["tied_head"]
    problem, mesh = _problem(layers, [1.0, 0.5], 2, space=Space.MEGATRON)
    loads = Loads.continuous(mesh, 8, Shares((0.6, 0.4), (0.5, 0.5), (1.0,)))
    program = astar(problem, loads)
    assert [c.strategy for c in program.choices] == [la.default for la in layers]
    full, _ = _problem(layers, [1.0, 0.5], 2)
    for program in (astar(full, loads), brute_force(full, loads)):
        embed, head = program.choices[0].strategy, program.choices[2].strategy
        pairs = {Strategy.ROW: Strategy.COLUMN, Strategy.COLUMN: Strategy.ROW}
        assert head is pairs.get(embed, embed)


def test_search_is_deterministic():
    layers = _graphs()["attention"]
    problem, mesh = _problem(layers, [1.0, 0.3, 0.7], 3)
    loads = Loads.continuous(mesh, 8, Shares((0.5, 0.2, 0.3), (0.4, 0.3, 0.3), (1.0,)))
    assert astar(problem, loads) == astar(problem, loads)
