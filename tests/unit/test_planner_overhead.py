"""The fixed per-layer cost term: it is charged on every layer and moves work off slow devices."""

from __future__ import annotations

import pytest
from transformers import GPT2Config

from colossal_hetero.planner import ClusterSpec, model_spec_from_hf, search_plan
from colossal_hetero.planner.search import Space


def _plan(overhead_s: float):
    hf = GPT2Config(n_layer=2, n_embd=512, n_head=16, n_positions=64, vocab_size=256)
    model = model_spec_from_hf(hf, batch_size=4, seq_len=64)
    cluster = ClusterSpec.from_relative(
        [1.0, 1.0, 0.5, 0.25],
        bandwidth_gbps=2.0,
        reference_flops=7e9,
        layer_overhead_s=overhead_s,
    )
    return search_plan(cluster, model, tp_size=4, space=Space.MEGATRON), len(model.layers)


def test_overhead_is_charged_once_per_layer_at_each_devices_speed():
    base, num_layers = _plan(0.0)
    loaded, _ = _plan(1e-3)
    # Every layer costs the slowest device (speed 0.25) at least 4 x 1 ms more.
    # float64 sums of a few hundred terms: ~1e-13 relative; 1e-6 is loose, a missed layer is 1%.
    assert loaded.even_step_time == pytest.approx(base.even_step_time + num_layers * 4e-3, rel=1e-6)


def test_overhead_moves_work_off_the_slowest_device():
    base, _ = _plan(0.0)
    loaded, _ = _plan(3e-3)
    assert loaded.widths["ffn"][3] < base.widths["ffn"][3]
    assert sum(loaded.widths["ffn"]) == sum(base.widths["ffn"])


def test_negative_overhead_is_rejected():
    with pytest.raises(ValueError, match="layer_overhead_flops must be >= 0"):
        ClusterSpec.from_relative([1.0], layer_overhead_s=-1.0)
