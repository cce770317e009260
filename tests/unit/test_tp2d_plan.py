"""Resizable 2D placement against brute force, the GPT-2 activation accounting against hand
counts, and the 1D/2D mode pick (all pure)."""

from __future__ import annotations

import itertools
import random

import pytest

from colossal_hetero.planner.tp2d_choice import (
    ModeEstimate,
    choose_tp_mode,
    estimate_modes,
    format_choice,
)
from colossal_hetero.planner.tp2d_cost import LayerDims, block_time, place_2d
from colossal_hetero.planner.tp2d_memory import gpt2_activation_bytes
from colossal_hetero.planner.tp2d_plan import (
    _canonical_placements,
    best_heads,
    plan_resizable_2d,
    proportional,
)


def test_exact_placement_equals_brute_force_on_2x2_meshes():
    rng = random.Random(7)
    for _ in range(40):
        speeds = [rng.choice([0.25, 0.5, 0.7, 1.0, 1.3]) for _ in range(4)]
        batch, heads = rng.randint(1, 7), rng.randint(1, 7)
        plan = plan_resizable_2d(speeds, batch, heads, ffn=4 * heads, vocab=16)
        brute = place_2d(speeds, batch, heads)
        assert plan.exact
        assert plan.slowest == pytest.approx(brute.slowest, rel=1e-12), (speeds, batch, heads)
        # The reported value is the real slowest block of the returned layout.
        assert block_time(speeds, plan.positions, plan.batch_sizes, plan.head_counts) == (
            pytest.approx(plan.slowest)
        )
        assert sum(plan.batch_sizes) == batch and sum(plan.head_counts) == heads


def test_one_half_speed_device_hand_computed():
    # Even 2 x 2: every block 6 samples x 6 heads; the half-speed one takes 36 / 0.5 = 72.
    # Resized: rows 6 / 6, columns 8 / 4 heads with the slow device in the 4-head column:
    # fast blocks 6 x 8 = 48 and 6 x 4 = 24, the slow one 6 x 4 / 0.5 = 48. Nothing beats 48
    # (brute force agrees), so 1.5x predicted.
    plan = plan_resizable_2d([1, 1, 1, 0.5], 12, 12, ffn=1536, vocab=256)
    assert plan.slowest == pytest.approx(48.0)
    assert plan.even_slowest == pytest.approx(72.0)
    assert plan.predicted_speedup == pytest.approx(1.5)
    assert sorted(plan.head_counts) == [4, 8]
    slow_position = plan.positions.index(3)
    i, j = divmod(slow_position, 2)
    assert plan.head_counts[j] == 4 and plan.batch_sizes[i] == 6
    assert plan.placement()[3] == (i, j)
    # MLP and vocabulary follow the heads: 1536 * 8/12 = 1024; 256 * 8/12 = 170.67 -> 171.
    assert sorted(plan.ffn_sizes) == [512, 1024]
    assert sorted(plan.vocab_sizes) == [85, 171]
    # batch 8, heads 8 (docs/tp2d.md): 24 against 32.
    small = plan_resizable_2d([1, 1, 1, 0.5], 8, 8, ffn=32, vocab=8)
    assert (small.slowest, small.even_slowest) == (24.0, 32.0)


def test_greedy_heads_are_optimal():
    rng = random.Random(3)
    for _ in range(50):
        caps = [rng.choice([0.1, 0.25, 0.5, 1.0, 2.0]) for _ in range(rng.randint(2, 3))]
        heads = rng.randint(1, 8)
        counts, worst = best_heads(caps, heads)
        best = min(
            max(a / c for a, c in zip(split, caps, strict=True) if a)
            for split in itertools.product(range(heads + 1), repeat=len(caps))
            if sum(split) == heads
        )
        assert sum(counts) == heads
        assert worst == pytest.approx(best)


def test_canonical_placements_cover_every_class_once():
    canon = _canonical_placements(2)
    assert len(canon) == 24 // (2 * 2)

    def grid(perm):
        rows = [perm[0:2], perm[2:4]]
        return {
            tuple(tuple(rows[r][c] for c in cols) for r in row_order)
            for row_order in itertools.permutations(range(2))
            for cols in itertools.permutations(range(2))
        }

    classes = [frozenset(grid(p)) for p in canon]
    assert len(set(classes)) == len(canon)
    everything = set().union(*classes)
    assert everything == {(p[0:2], p[2:4]) for p in itertools.permutations(range(4))}


def test_local_search_never_worse_than_even_and_equal_speeds_stay_even():
    forced = plan_resizable_2d([1, 1, 1, 0.5], 12, 12, 48, 12, max_evaluations=1)
    assert not forced.exact
    assert forced.slowest <= forced.even_slowest
    assert forced.slowest >= 48.0  # never better than the exact optimum
    equal = plan_resizable_2d([1.0] * 9, 6, 6, 24, 9, max_evaluations=1)
    assert equal.slowest == pytest.approx(equal.even_slowest) == pytest.approx(4.0)


def test_proportional_and_bad_input():
    assert proportional(256, [8, 4]) == (171, 85)
    assert proportional(10, [1, 1, 1]) == (4, 3, 3)
    assert proportional(7, [0, 2]) == (0, 7)
    with pytest.raises(ValueError, match="parallel.tp"):
        plan_resizable_2d([1, 1, 1], 4, 4, 16, 8)
    with pytest.raises(ValueError, match="cluster.devices"):
        plan_resizable_2d([1, 1, 1, 0], 4, 4, 16, 8)


def test_gpt2_activation_bytes_hand_counted():
    # 1 layer, batch 2 x 16 tokens (T = 32), h = 64, 4 heads, f = 256, V = 256, tp = 4, fp32.
    # 1D per layer: whole 4 T h = 8192; split (4 T h + 5 T f + a s T) / 4 = (8192 + 40960 +
    # 2048) / 4 = 12800; LN statistics 4 T = 128 -> 21120 floats = 84480 B, causal mask 256 B.
    # Final: ln_f input and LM head input 2 T h = 4096 floats, statistics 64, loss
    # exp-logits 30 x 64 = 1920 floats -> 6080 floats = 24320 B, + 30 bools + 30 int64 (270 B).
    # Indices: 32 ids + 16 positions, int64 = 384 B. Total 84480 + 256 + 24320 + 270 + 384.
    kw = dict(layers=1, batch=2, seq=16, hidden=64, heads=4, vocab=256, tp=4)
    assert gpt2_activation_bytes("1d", **kw) == 84480 + 256 + 24320 + 270 + 384
    # 1D + SP: whole 2 T h = 4096; split (8 T h + 5 T f + a s T) / 4 = 14848; statistics 32.
    assert gpt2_activation_bytes("1d-sp", **kw) == 4 * (4096 + 14848 + 32) + 256 + 24320 + 654
    # 1D with a one-kernel GELU: the MLP keeps 2 T f / 4 = 4096 floats instead of 10240.
    lean = gpt2_activation_bytes("1d", lean_gelu=True, **kw)
    assert lean == 84480 - 4 * (10240 - 4096) + 256 + 24320 + 270 + 384
    # 2D, rank (0, 0): T_i = 16, h_j = 32, f_j = 128, a_j = 2: 8 T_i h_j + 2 T_i f_j +
    # a_j s T_i + 2 T_i = 4096 + 4096 + 512 + 32 = 8736 floats; final: 2 T_i h_j + T_i +
    # 15 x 128 + 15 = 2975 floats, + 15 int64 + 15 bools; indices: 48 int64 + 32 floats.
    two_d = 4 * 8736 + 256 + 4 * 2975 + 15 * 9 + 48 * 8 + 32 * 4
    assert gpt2_activation_bytes("2d", **kw) == two_d
    with pytest.raises(ValueError, match="tp_mode"):
        gpt2_activation_bytes("3d", **kw)  # type: ignore[arg-type]


def _estimate(mode: str, memory: float, comm: float, fits: bool) -> ModeEstimate:
    return ModeEstimate(mode, 0, 0.0, memory, 0.0, 0, comm, fits)


def test_mode_pick_rules():
    both = {"1d": _estimate("1d", 10, 2.0, True), "2d": _estimate("2d", 8, 3.0, True)}
    assert choose_tp_mode(both, 4).mode == "1d"  # both fit: less communication wins
    only_2d = {"1d": _estimate("1d", 10, 2.0, False), "2d": _estimate("2d", 8, 3.0, True)}
    assert choose_tp_mode(only_2d, 4).mode == "2d"
    neither = {"1d": _estimate("1d", 10, 2.0, False), "2d": _estimate("2d", 8, 3.0, False)}
    assert choose_tp_mode(neither, 4).mode == "2d"
    assert choose_tp_mode(only_2d, 2).mode == "1d"  # not a square
    assert choose_tp_mode(only_2d, 4, supports_2d=False).mode == "1d"


def test_estimates_from_the_cost_models():
    dims = LayerDims(batch=8, seq=128, hidden=256, heads=8, elem_bytes=4, dropout=False)
    roomy = estimate_modes(
        dims, 4, 2, 256, bandwidth_bytes_s=1e9, latency_s=1e-5, memory_bytes=2**40
    )
    assert set(roomy) == {"1d", "1d-sp", "2d"}
    # 2D moves 3 (7 bsh + 12 h^2) / q words per layer, 1D 8 bsh (P - 1) / P (tp2d_cost).
    bsh, h2 = 8 * 128 * 256, 256 * 256
    assert roomy["1d"].comm_bytes == pytest.approx(2 * 4 * 8 * bsh * 3 / 4)
    assert roomy["2d"].comm_bytes == pytest.approx(2 * 4 * 3 * (7 * bsh + 12 * h2) / 2, rel=0.02)
    assert roomy["2d"].activation_bytes < roomy["1d"].activation_bytes
    # A budget between the two: only 2D fits, so auto picks it.
    budget = (roomy["1d"].memory_bytes + roomy["2d"].memory_bytes) / 2
    tight = estimate_modes(
        dims, 4, 2, 256, bandwidth_bytes_s=1e9, latency_s=1e-5, memory_bytes=budget
    )
    choice = choose_tp_mode(tight, 4)
    assert choice.mode == "2d" and "only 2D fits" in choice.reason
    assert "tp_mode auto: 2d" in format_choice(choice, "auto")


def test_auto_resolves_from_a_run_config():
    from dataclasses import replace

    from colossal_hetero.config.schema import RunConfig
    from colossal_hetero.planner.tp2d_choice import choose_for_config, resolved_tp_mode

    base = RunConfig()
    parallel = base.parallel
    if not hasattr(parallel, "tp_mode"):
        pytest.skip("parallel.tp_mode not in this schema yet")
    hf = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256}
    config = replace(
        base,
        model=replace(base.model, arch="gpt2", hf=hf),
        parallel=replace(parallel, tp=4, tp_mode="auto"),
    )
    assert resolved_tp_mode(config, 4) == choose_for_config(config, 4).mode
    assert (
        resolved_tp_mode(replace(config, parallel=replace(parallel, tp=2, tp_mode="auto")), 2)
        == "1d"
    )
    assert (
        resolved_tp_mode(replace(config, parallel=replace(parallel, tp=4, tp_mode="2d")), 4) == "2d"
    )


def test_tp2d_plan_places_every_tp_group_alike_for_the_slowest_replica():
    """plan.tp2d for tp 4 x dp 2: the k-th ranks of both TP groups (a data-parallel group)
    get one position; the speeds planned for are the slower of each pair; the block sizes
    are those of plan_resizable_2d for those speeds."""
    from colossal_hetero.planner.tp2d_plan import plan_tp2d

    speeds = [1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0]  # rank 5: index 1 of the second group
    groups = [(4, 5, 6, 7), (0, 1, 2, 3)]
    plan = plan_tp2d(speeds, groups, 12, 12, 3072, 256)
    assert plan.speeds == (1.0, 0.5, 1.0, 1.0)
    direct = plan_resizable_2d(list(plan.speeds), 12, 12, 3072, 256)
    assert plan.batch_sizes == direct.batch_sizes and plan.head_counts == direct.head_counts
    assert plan.predicted_speedup == pytest.approx(1.5)
    placement = plan.placement_of(groups)
    assert sorted(placement) == list(range(8))
    for k in range(4):
        assert placement[k] == placement[4 + k] == plan.index_positions[k]
    # Every block, the slow index's included, within the optimum 48 (hand count above).
    for k, (i, j) in enumerate(plan.index_positions):
        assert plan.batch_sizes[i] * plan.head_counts[j] / plan.speeds[k] <= 48.0
    assert len(set(plan.index_positions)) == 4
    assert plan.tp2d is plan
    assert plan.to_dict()["index_positions"][1] == list(plan.index_positions[1])


def test_tp2d_plan_without_a_batch_keeps_rows_even_and_refuses_bad_groups():
    from colossal_hetero.planner.tp2d_plan import plan_tp2d

    plan = plan_tp2d([1.0, 1.0, 1.0, 0.5], [(0, 1, 2, 3)], None, 12, 3072, 256)
    assert plan.batch_sizes == ()
    # Even rows (1, 1 per unit batch): the best columns put the slow device in the narrow
    # one, 8 / 4 heads, as with the batch known.
    assert sorted(plan.head_counts) == [4, 8]
    with pytest.raises(ValueError, match="parallel.tp: 2D tensor parallelism needs a square"):
        plan_tp2d([1.0, 1.0, 0.5], [(0, 1, 2)], 6, 12, 3072, 256)
    with pytest.raises(ValueError, match="cluster.devices: 2 devices listed"):
        plan_tp2d([1.0, 0.5], [(0, 1, 2, 3)], 6, 12, 3072, 256)
    with pytest.raises(ValueError, match="parallel.tp: the 2D plan is for TP groups of 4"):
        plan.placement_of([(0, 1)])


def test_plan_command_shows_the_plan_the_plugin_applies():
    """``colossal-hetero plan``'s 2D line is plan_tp2d over every TP group (consecutive ranks,
    Colossal-AI's mesh with pp 1) at one data-parallel batch: tp 4 x dp 2, 8 devices."""
    from dataclasses import replace

    from colossal_hetero.config import load_config
    from colossal_hetero.config.schema import DeviceSpec
    from colossal_hetero.models import build_hf_config
    from colossal_hetero.planner.tp2d_choice import choose_for_config, format_choice
    from colossal_hetero.planner.tp2d_plan import plan_tp2d

    config = load_config("configs/gpt2_tp2d_hetero.yaml")
    speeds = [1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 0.5, 1.0]
    devices = [DeviceSpec(speed=s) for s in speeds]
    config = replace(config, cluster=replace(config.cluster, devices=devices))
    choice = choose_for_config(config, 8)
    hf = build_hf_config(config.model)
    batch = config.data.global_batch_size // 2
    groups = [range(4), range(4, 8)]
    expected = plan_tp2d(speeds, groups, batch, hf.n_head, 4 * hf.n_embd, hf.vocab_size)
    assert choice.resizable == expected
    assert expected.speeds == (1.0, 1.0, 0.5, 0.5)  # the slower of each data-parallel pair
    assert expected.summary() in format_choice(choice, "2d")


def test_affine_blocks_against_brute_force_and_by_hand():
    """With a per-rank overhead o, blocks take (o + b_i a_j) / speed: the planner's optimum
    equals brute force over every placement and every pair of splits; for one half-speed device
    and o = 12 (bench tp2d's order) the narrow column gets 3 heads, not 4 (by hand: 8/4 gives
    max(12 + 48, (12 + 24) / 0.5) = 72, 9/3 gives max(66, 60) = 66, 10/2 gives 72)."""
    from colossal_hetero.planner.tp2d_plan import slowest_block

    rng = random.Random(3)
    for _ in range(25):
        speeds = [rng.choice([0.25, 0.5, 1.0, 1.3]) for _ in range(4)]
        batch, heads, overhead = rng.randint(1, 6), rng.randint(1, 6), rng.choice([0.5, 3, 12])
        plan = plan_resizable_2d(speeds, batch, heads, 4 * heads, 16, overhead=overhead)
        brute = min(
            slowest_block(speeds, perm, (b, batch - b), (a, heads - a), overhead)
            for perm in itertools.permutations(range(4))
            for b in range(batch + 1)
            for a in range(heads + 1)
        )
        assert plan.slowest == pytest.approx(brute, rel=1e-12), (speeds, batch, heads, overhead)
        assert slowest_block(
            speeds, plan.positions, plan.batch_sizes, plan.head_counts, overhead
        ) == pytest.approx(plan.slowest)
    plan = plan_resizable_2d([1, 1, 1, 0.5], 12, 12, 3072, 256, overhead=12.0)
    assert plan.slowest == pytest.approx(66.0) and plan.even_slowest == pytest.approx(96.0)
    assert sorted(plan.head_counts) == [3, 9] and plan.batch_sizes == (6, 6)
    i, j = plan.placement()[3]
    assert plan.head_counts[j] == 3


def test_resizable_plan_for_llama_and_vit():
    """dims_2d reads each supported model. Llama: every column holds whole key/value groups,
    the plan's slowest block equals a brute force over every placement, batch split and
    split of the groups, and the 2D conversion's checks accept the plan. ViT: the columns
    split the classes, and the checks accept it too."""
    from transformers import BertConfig, GPT2Config, LlamaConfig, ViTConfig

    from colossal_hetero.planner.tp2d_plan import dims_2d, plan_tp2d
    from colossal_hetero.tp2d.convert import check_model_2d

    speeds, group = [1.0, 1.0, 1.0, 0.5], [(0, 1, 2, 3)]
    llama = LlamaConfig(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=96,
        num_hidden_layers=1,
    )
    assert dims_2d(llama) == (8, 128, 96, 4)
    heads, ffn, vocab, unit = dims_2d(llama)
    plan = plan_tp2d(speeds, group, 8, heads, ffn, vocab, head_unit=unit)
    assert sum(plan.head_counts) == 8 and all(a % 4 == 0 for a in plan.head_counts)
    best = min(
        max(b[i] * a[j] / speeds[perm[i * 2 + j]] for i in range(2) for j in range(2))
        for perm in itertools.permutations(range(4))
        for b in [(k, 8 - k) for k in range(9)]
        for a in ((0, 8), (4, 4), (8, 0))
    )
    got = max(
        plan.batch_sizes[i] * plan.head_counts[j] / plan.speeds[k]
        for k, (i, j) in enumerate(plan.index_positions)
    )
    assert got == pytest.approx(best) and best == pytest.approx(24.0)  # even: 4 * 4 / 0.5
    shares = check_model_2d(llama, 2, plan)
    assert shares.head_counts == plan.head_counts and shares.ffn_sizes == plan.ffn_sizes
    vit = ViTConfig(
        hidden_size=48,
        num_attention_heads=6,
        intermediate_size=96,
        num_labels=10,
        image_size=8,
        patch_size=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    assert dims_2d(vit) == (6, 96, 10, 1)
    plan = plan_tp2d(speeds, group, 8, *dims_2d(vit)[:3])
    assert sum(plan.vocab_sizes) == 10 and sum(plan.head_counts) == 6
    assert check_model_2d(vit, 2, plan).vocab_sizes == plan.vocab_sizes
    assert dims_2d(GPT2Config(n_embd=32, n_head=4)) == (4, 128, 50257, 1)
    with pytest.raises(ValueError, match="model.arch"):
        dims_2d(BertConfig())
    with pytest.raises(ValueError, match="whole groups of 3"):
        plan_tp2d(speeds, group, 8, 8, 128, 96, head_unit=3)
