"""Cost model: collective formulas with padding waste, compute, memory, and LP consistency."""

from __future__ import annotations

import types

import numpy as np
import pytest

from colossal_hetero.planner.affine import Affine
from colossal_hetero.planner.cost import (
    Collective,
    CostModel,
    GradSync,
    Layout,
    Loads,
    Placement,
    Shares,
    Tensor,
)
from colossal_hetero.planner.hf import model_spec_from_hf
from colossal_hetero.planner.search import Problem, Space, astar
from colossal_hetero.planner.shares import initial_shares, optimize_shares, program_rows
from colossal_hetero.planner.spec import ClusterSpec, Mesh, Strategy
from tests.tolerances import FLOAT64_FORMULA_RTOL


def _gpt2(layers=2, hidden=64, heads=4, vocab=256):
    return types.SimpleNamespace(
        model_type="gpt2",
        n_embd=hidden,
        n_head=heads,
        n_layer=layers,
        n_inner=None,
        vocab_size=vocab,
        n_positions=128,
        tie_word_embeddings=True,
    )


def _cost(speeds, tp, *, bandwidths=None, latency=1e-5, batch=8, dtype=4) -> CostModel:
    n = len(speeds)
    cluster = ClusterSpec(
        speeds=tuple(s * 1e12 for s in speeds),
        memory_bytes=(2.0**34,) * n,
        bandwidths=tuple(bandwidths or [1e9] * n),
        latency_s=latency,
    )
    model = model_spec_from_hf(_gpt2(), batch_size=batch, seq_len=32, dtype_bytes=dtype)
    return CostModel(cluster, model, Mesh.for_devices(n, tp))


def test_padded_gather_moves_the_largest_shard_every_step():
    cm = _cost([1, 1, 1, 1], 4, bandwidths=[4e9, 1e9, 2e9, 4e9], latency=1e-5)
    shard = np.array([100.0, 700.0, 200.0, 0.0])
    padded = float(np.max(cm.gather(shard, "tp", Collective.PADDED)))
    assert padded == pytest.approx(
        3 * 700.0 / 1e9 + 3 * 1e-5, rel=FLOAT64_FORMULA_RTOL
    )  # O-H6: (m-1) max_d s_d / bw_min


def test_grouped_gather_receives_true_sizes():
    bw = np.array([4e9, 1e9, 2e9, 4e9])
    cm = _cost([1, 1, 1, 1], 4, bandwidths=list(bw), latency=0.0)
    shard = np.array([100.0, 700.0, 200.0, 0.0])
    grouped = cm.gather(shard, "tp", Collective.GROUPED)
    expected = (shard.sum() - shard) / (cm.cluster.grouped_efficiency * bw)
    np.testing.assert_allclose(grouped, expected, rtol=FLOAT64_FORMULA_RTOL)


def test_grouped_pays_only_when_padding_wastes():
    cm = _cost([1] * 4, 4, latency=0.0)
    even, skewed = np.full(4, 250.0), np.array([970.0, 10.0, 10.0, 10.0])
    for shard, grouped_wins in ((even, False), (skewed, True)):
        padded = np.max(cm.gather(shard, "tp", Collective.PADDED))
        grouped = np.max(cm.gather(shard, "tp", Collective.GROUPED))
        assert bool(grouped < padded) == grouped_wins


def test_ring_allreduce_and_one_device_groups_cost_nothing():
    cm = _cost([1, 1, 1, 1], 2, bandwidths=[1e9, 3e9, 2e9, 2e9], latency=1e-5)
    ar = cm.allreduce(np.full(4, 1000.0), "tp")
    np.testing.assert_allclose(ar[:2], 2 * 0.5 * 1000.0 / 1e9 + 2 * 1e-5, rtol=FLOAT64_FORMULA_RTOL)
    np.testing.assert_allclose(ar[2:], 2 * 0.5 * 1000.0 / 2e9 + 2 * 1e-5, rtol=FLOAT64_FORMULA_RTOL)
    solo = _cost([1, 1], 1)
    assert not np.any(solo.allreduce(np.full(2, 1e6), "tp"))


def test_transitions_charge_forward_and_backward():
    cm = _cost([1, 1], 2)
    loads = Loads.continuous(cm.mesh, 8, Shares((0.75, 0.25), (0.5, 0.5), (1.0,)))
    x = Tensor(32, 64)
    dim = cm.model.layers[2].out_shard
    r, f, p, b = (
        Placement(Layout.R),
        Placement(Layout.F, dim),
        Placement(Layout.P),
        Placement(Layout.B),
    )
    labels = {
        (r, f): ["all-gather (bwd)"],
        (f, r): ["all-gather"],
        (p, r): ["all-reduce"],
        (p, f): ["reduce-scatter", "all-gather (bwd)"],
        (b, f): ["all-to-all", "all-to-all (bwd)"],
        (r, r): [],
    }
    for (src, dst), expected in labels.items():
        terms, _ = cm.transition(x, src, dst, Collective.PADDED, loads)
        assert [t.label for t in terms] == expected
    assert cm.transition(x, r, p, Collective.PADDED, loads) is None
    assert cm.transition(x, Placement(Layout.INPUT), f, Collective.PADDED, loads) is None
    # Bytes counted in full: 8 samples x 32 tokens x 64 features x 4 bytes, all-reduced.
    terms, _ = cm.transition(x, p, r, Collective.PADDED, loads)
    full = 8 * 32 * 64 * 4
    assert float(np.max(terms[0].rows)) == pytest.approx(
        full / 1e9 + 2 * 1e-5, rel=FLOAT64_FORMULA_RTOL
    )


def test_compute_and_memory_of_a_column_layer():
    cm = _cost([1.0, 0.5], 2, dtype=2)
    qkv = cm.model.layers[2]
    loads = Loads.continuous(cm.mesh, 8, Shares((0.75, 0.25), (0.5, 0.5), (1.0,)))
    terms, _ = cm.layer_terms(qkv, Strategy.COLUMN, GradSync.ALLREDUCE, Collective.PADDED, loads)
    flops = 3 * qkv.flops_per_token * qkv.tokens * 8  # forward + 2x backward, 8 samples
    np.testing.assert_allclose(
        terms[0].rows, flops * np.array([0.75, 0.25]) / [1e12, 0.5e12], rtol=FLOAT64_FORMULA_RTOL
    )
    assert [t.label for t in terms] == ["compute", "dX all-reduce"]  # dp = 1: no grad ring
    memory = cm.memory(qkv, Strategy.COLUMN, loads)
    params = (qkv.weight_params + qkv.bias_params) * np.array([0.75, 0.25])
    state = 2 + 2 + 8 + 4  # bf16 weight and grad, Adam fp32 moments, fp32 master copy
    acts = 8 * 32 * qkv.in_features * 2  # replicated input saved for backward
    np.testing.assert_allclose(memory, params * state + acts, rtol=FLOAT64_FORMULA_RTOL)


def test_lp_rows_equal_the_cost_model_at_the_solution():
    """The rows the LP optimises are the cost model's own formulas, constants included."""
    cm = _cost([1.0, 0.6, 0.3, 1.0], 2, bandwidths=[1e9, 2e9, 1e9, 5e8])
    problem = Problem(cm, Space.FULL)
    start = initial_shares(cm.cluster, cm.mesh)
    program = astar(problem, Loads.continuous(cm.mesh, 8, start))
    shares = Shares((0.7, 0.3), (0.4, 0.6), (0.55, 0.45))
    numeric, mem = program_rows(problem, program, Loads.continuous(cm.mesh, 8, shares))
    free_tp, mem_tp = program_rows(problem, program, Loads.free_tp(cm.mesh, 8, shares))
    free_dp, mem_dp = program_rows(problem, program, Loads.free_groups(cm.mesh, 8, shares))
    x_tp, x_dp = np.array(shares.tp + shares.batch), np.array(shares.groups)
    for (rows, w), (a, wa), (b, wb) in zip(numeric, free_tp, free_dp, strict=True):
        for affine, x in ((a, x_tp), (b, x_dp)):
            value = affine.value(x) if isinstance(affine, Affine) else affine
            # float64, the same terms in another order; atol for exact zeros.
            np.testing.assert_allclose(value, rows, rtol=1e-12, atol=1e-18)
        assert w == wa == wb
    np.testing.assert_allclose(mem_tp.value(x_tp), mem, rtol=FLOAT64_FORMULA_RTOL)
    np.testing.assert_allclose(mem_dp.value(x_dp), mem, rtol=FLOAT64_FORMULA_RTOL)


def test_share_lp_never_worsens_the_program():
    cm = _cost([1.0, 0.25, 0.5, 0.5], 2, bandwidths=[1e9, 1e9, 3e9, 3e9])
    problem = Problem(cm, Space.FULL)
    start = initial_shares(cm.cluster, cm.mesh)
    program = astar(problem, Loads.continuous(cm.mesh, 8, start))
    shares = optimize_shares(problem, program, start)
    from colossal_hetero.planner.search import program_cost

    before = program_cost(problem, program.choices, Loads.continuous(cm.mesh, 8, start))
    after = program_cost(problem, program.choices, Loads.continuous(cm.mesh, 8, shares))
    assert after <= before + 1e-15  # costs ~1e-3 s in float64: 1e-15 is ~1e-12 relative
    assert sum(shares.tp) == pytest.approx(1, rel=FLOAT64_FORMULA_RTOL) and sum(
        shares.groups
    ) == pytest.approx(1, rel=FLOAT64_FORMULA_RTOL)
