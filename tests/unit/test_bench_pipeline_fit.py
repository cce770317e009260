"""Phase (c)'s device model fitted to the probe run (bench/pipeline_fit.py).

Oracles: GPT-2's per-token FLOPs written out by hand from its shapes, shares computed by hand
for given widths, and probe totals generated from a known fixed cost and rate (the fit must
give them back).
"""

from __future__ import annotations

import pytest
from transformers import GPT2Config

from colossal_hetero.bench.pipeline_fit import block_work, fit_device_model, fit_line, rank_share
from colossal_hetero.planner.hf import model_spec_from_hf

H, S = 128, 32


def _spec():
    config = GPT2Config(n_layer=3, n_embd=H, n_head=4, vocab_size=256, n_positions=S)
    return model_spec_from_hf(config, 16, S)


def test_block_work_is_gpt2s_flops_by_width():
    work, layers, tokens = block_work(_spec())
    # Forward FLOPs per token: QKV 2*h*3h, scores and values 2*s*h each, projection 2*h*h;
    # MLP up and down 2*h*4h each; two layer norms 8*h each (replicated on every rank).
    assert work["heads"] == 6 * H * H + 4 * S * H + 2 * H * H
    assert work["ffn"] == 16 * H * H
    assert work["replicated"] == 16 * H
    assert (layers, tokens) == (7, S)


def test_rank_share_weighs_each_width_by_its_flops():
    work, _, _ = block_work(_spec())
    widths = {"heads": (1, 3), "ffn": (128, 384), "vocab": (128, 128)}
    heads, ffn, norms = 8 * H * H + 4 * S * H, 16 * H * H, 16 * H
    total = heads + ffn + norms
    assert rank_share(work, widths, 0) == pytest.approx((norms + heads / 4 + ffn / 4) / total)
    assert rank_share(work, widths, 1) == pytest.approx(
        (norms + 3 * heads / 4 + 3 * ffn / 4) / total
    )
    assert rank_share(work, {}, 0) == pytest.approx(norms / total)  # no widths: only norms


def test_fit_line_recovers_a_line_and_refuses_what_is_no_rate():
    assert fit_line([(0.2, 1.4), (0.5, 2.0), (0.9, 2.8)]) == pytest.approx((1.0, 2.0))
    assert fit_line([(0.5, 1.0), (0.5, 1.2)]) is None  # equal widths: nothing to fit
    assert fit_line([(0.2, 2.0), (0.8, 1.0)]) is None  # more work, less time: noise


def test_fit_device_model_gives_back_the_fixed_cost_and_rate_it_was_made_of():
    spec = _spec()
    work, layers, tokens = block_work(spec)
    fixed, full, passes, microbatch = 1.5e-3, 2.0e-3, 192.0, 2
    widths = {"heads": (1, 3), "ffn": (160, 352)}

    def totals(index: int) -> dict[str, float]:
        return {
            "work_s": passes * (fixed + full * rank_share(work, widths, index)),
            "passes": passes,
        }

    probe = {"flops": 9e10, "layer_overhead_s": 9e-5, "gbps": 0.007, "latency_s": 1e-4}
    fitted = fit_device_model(probe, spec, microbatch, [(widths, i, totals(i)) for i in (0, 1)])
    assert fitted is not None
    model, fit = fitted["device_model"], fitted["fit"]
    # A block's forward + backward on one micro-batch is two passes: 2 * fixed over its 7
    # layers, and its FLOPs (forward and twice that backward) in 2 * full at a full share.
    assert model["layer_overhead_s"] == pytest.approx(2 * fixed / layers)
    flops = 3 * sum(work.values()) * tokens * microbatch
    assert model["flops"] == pytest.approx(flops / (2 * full))
    assert (model["gbps"], model["latency_s"]) == (0.007, 1e-4)  # the links as probed
    assert fit["pass_fixed_s"] == pytest.approx(fixed) and fit["pass_full_s"] == pytest.approx(full)
    even = {"heads": (2, 2), "ffn": (256, 256)}
    assert fit_device_model(probe, spec, microbatch, [(even, i, totals(0)) for i in (0, 1)]) is None


def test_pp_alone_keeps_its_probe_without_asking_for_widths():
    """PP=4's probe is Colossal-AI's plugin (no ``stage_widths``): the refit leaves the spec,
    probe and measurement as they are, before any collective."""
    from types import SimpleNamespace

    from colossal_hetero.bench.pipeline_split import refit_and_probe

    spec = {"tp": 1, "pp": 4, "slow_stage": 1, "device_model": {"flops": 1.0}}
    probe = SimpleNamespace(plugin=object())  # any attribute read would raise
    measured = {"stage_times": [[0.1, 0.0]] * 4}
    got = refit_and_probe(spec, None, probe, None, [0, 1, 2, 3], probe, measured)  # type: ignore[arg-type]
    assert got[0] is spec and got[1] is probe and got[2] is measured
