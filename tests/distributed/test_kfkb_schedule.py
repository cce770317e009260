"""KFKBSchedule on gloo ranks, tiny GPT-2: loss and gradients equal Colossal-AI's 1F1B.

2 ranks (PP=2) by default; 4 ranks (PP=4, PP=2 x DP=2, PP=2 x uneven TP=2) marked slow. Under
TP each rank sends half of every message and the receiving stage gathers the halves (TPSlice):
the rebuilt tensors must still give 1F1B's gradients bit for bit.

Exact equality in fp32: kFkB runs the same forward_step/backward_step as 1F1B, and on every stage
forwards and backwards each run in increasing micro-batch order, so the last stage sums the loss
and every stage accumulates parameter gradients in the same order. Nothing may differ by a bit.
"""

from __future__ import annotations

import time

import pytest
import torch
from colossalai.booster import Booster
from colossalai.pipeline.schedule import OneForwardOneBackwardSchedule

from colossal_hetero.config import HeteroConfig, ModelConfig, ParallelConfig
from colossal_hetero.models import build_model, loss_from_outputs
from colossal_hetero.pipeline.controller import AdaKController
from colossal_hetero.pipeline.schedule import KFKBSchedule
from colossal_hetero.pipeline.tuner import stage_of_rank
from colossal_hetero.plugin import HeteroParallelPlugin
from colossal_hetero.policies import resizable_policy
from tests.dist_utils import run_distributed

GPT2 = ModelConfig(
    arch="gpt2",
    hf={
        "n_layer": 4,
        "n_embd": 32,
        "n_head": 4,
        "n_positions": 32,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
)


def _batch(batch_size: int, seq_len: int = 16, seed: int = 1234) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (batch_size, seq_len), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _step(booster, model, optimizer, criterion, batch):
    """One forward/backward through the plugin's current scheduler; (loss, grads), grads zeroed."""
    result = booster.execute_pipeline(iter([batch]), model, criterion, optimizer, return_loss=True)
    grads = {n: p.grad.clone() for n, p in model.unwrap().named_parameters() if p.grad is not None}
    optimizer.zero_grad()
    loss = result["loss"]
    return (None if loss is None else loss.clone()), grads


def _assert_same(got, want, what):
    loss, grads = got
    want_loss, want_grads = want
    assert (loss is None) == (want_loss is None), what
    if loss is not None:
        assert torch.equal(loss, want_loss), f"{what}: loss {loss} vs {want_loss}"
    assert grads.keys() == want_grads.keys() and grads, what
    for name, g in grads.items():
        assert torch.equal(g, want_grads[name]), f"{what}: gradient of {name} differs"


def _check_controller(schedule: KFKBSchedule, booster, model, optimizer, criterion, batch):
    """AdaKController on 2 stages, m=4, with a 5 s latency on every link (compute is ms).

    1F1B pays the 10 s round trip twice (about 20 s); k=2 hides the second behind the other
    group (about 10 s; k=3 and 4 differ from it by milliseconds of measured compute, inside the
    controller's 1% min_gain, so the tie goes to 2 whatever the machine load). A budget of 2
    micro-batches (stage 0 holds min(2k, 4)) leaves only k=1. The same k lands on every rank."""
    stats = schedule.last_stats
    assert stats is not None
    layout = stage_of_rank(pp=2, tp=1, dp=torch.distributed.get_world_size() // 2)
    budgets = {"large": 1e12, "two micro-batches": 2.0 * stats.activation_bytes + 1.0}
    for name, want in (("large", 2), ("two micro-batches", 1), ("large", 2)):
        control = AdaKController(schedule, layout, budgets[name], latency_s=5.0, period=2)
        assert control.after_step(0) is None  # not a retuning step: no collective
        record = control.after_step(1)
        assert record is not None, name
        assert record["decision"]["k"] == want == schedule.k, (name, record["decision"])
        seen = [torch.zeros(1) for _ in layout]
        torch.distributed.all_gather(seen, torch.tensor([float(schedule.k)]))
        assert [int(x) for x in seen] == [want] * len(layout)
        _step(booster, model, optimizer, criterion, batch)  # runs with the new k


HOOK_S = 1.0
"""Seconds the test's ``before_step`` hook sleeps: a tiny step takes milliseconds, so a
``step_s`` that counted the hook would exceed it."""


def _check_hook(schedule: KFKBSchedule, booster, model, optimizer, criterion, batch, reference):
    """``before_step`` runs before any pass that depends on ``k``: on the first stage after
    micro-batch 0's forward (the first pass of every ``k``'s order), elsewhere before any
    pass. A hook that switches ``k = 1`` to ``2`` there gives a step that ran ``k = 2``
    (peak in flight ``min(2 (p - s), m)``), with 1F1B's loss and gradients bit for bit, and
    ``step_s`` leaves the hook's seconds out."""
    sm = schedule.stage_manager
    p, s, m = sm.num_stages, sm.stage, schedule.num_microbatches
    in_flight_at_hook = []

    def hook() -> None:
        in_flight_at_hook.append(schedule.peak_saved)
        schedule.set_k(2)
        time.sleep(HOOK_S)

    schedule.set_k(1)
    schedule.before_step = hook
    try:
        got = _step(booster, model, optimizer, criterion, batch)
    finally:
        schedule.before_step = None
    _assert_same(got, reference, f"k switched by before_step on stage {s}")
    assert in_flight_at_hook == [1 if sm.is_first_stage() else 0], in_flight_at_hook
    assert schedule.peak_saved == min(2 * (p - s), m)
    assert schedule.last_stats is not None and schedule.last_stats.step_s < HOOK_S


def _check_link_units(schedule, step, reference, ks, rank, tp: int) -> None:
    """Uneven pieces over the TP links (activations 3:13 units, gradients 11:5), then equal
    again: every rebuilt message still gives 1F1B's loss and gradients bit for bit, and each
    rank puts its own piece's bytes on its link (1024 elements: 192 and 832 for 3:13)."""
    schedule.set_link_units([(3, 13)], [(11, 5)])
    for k in ks:
        schedule.set_k(k)
        _assert_same(step(), reference, f"units 3:13 k={k} rank={rank}")
        last = schedule.stage_manager.is_last_stage()
        want = 0 if last else 4 * 1024 * (3, 13)[rank % tp] // 16
        assert schedule.last_stats.message_bytes == want
    schedule.set_link_units([(8, 8)], [(8, 8)])
    _assert_same(step(), reference, f"units back to even rank={rank}")
    with pytest.raises(ValueError, match="^link units"):
        schedule.set_link_units([(16, 0)], [(8, 8)])


def _check_layout(
    rank, config: HeteroConfig, ks: list[int], policy=None, controller: bool = False
) -> dict[str, int]:
    """1F1B once, then KFKBSchedule with each k in turn (one object), all on the same batch.

    Returns the number of elements of each parameter this rank holds.
    """
    m = config.parallel.num_microbatches
    plugin = HeteroParallelPlugin(config, policy=policy)
    try:
        engine = plugin.engine
        assert type(engine.scheduler) is OneForwardOneBackwardSchedule
        torch.manual_seed(0)
        model = build_model(GPT2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        booster = Booster(plugin=plugin)
        model, optimizer, criterion, _, _ = booster.boost(model, optimizer, loss_from_outputs)
        batch = _batch(2 * m)
        reference = _step(booster, model, optimizer, criterion, batch)
        stage, p = engine.stage_manager.stage, engine.stage_manager.num_stages
        tp = config.parallel.tp  # TP ranks send 1/tp of each message, the receivers gather
        group = engine.tp_group if tp > 1 else None
        schedule = KFKBSchedule(engine.stage_manager, num_microbatches=m, k=ks[0], tp_group=group)
        engine.scheduler = schedule
        saved_bytes = set()
        for k in ks:  # one schedule, k changed between steps
            schedule.set_k(k)
            got = _step(booster, model, optimizer, criterion, batch)
            _assert_same(got, reference, f"m={m} k={k} rank={rank}")
            assert schedule.peak_saved == min(k * (p - stage), m)
            stats = schedule.last_stats
            assert stats is not None and stats.forward_s > 0 and stats.backward_s > 0
            # One activation message: hidden states [micro-batch 2, seq 16, hidden 32] in fp32,
            # of which each of the tp ranks puts 1/tp on its link.
            last = engine.stage_manager.is_last_stage()
            assert stats.message_bytes == (0 if last else 2 * 16 * GPT2.hf["n_embd"] * 4 // tp)
            saved_bytes.add(stats.activation_bytes)
        # The same micro-batch computation saves the same tensors whatever the order.
        assert len(saved_bytes) == 1 and saved_bytes.pop() > 0
        if tp > 1:
            again = lambda: _step(booster, model, optimizer, criterion, batch)  # noqa: E731
            _check_link_units(schedule, again, reference, ks, rank, tp)
        if controller:
            _check_hook(schedule, booster, model, optimizer, criterion, batch, reference)
            _check_controller(schedule, booster, model, optimizer, criterion, batch)
        with pytest.raises(ValueError, match="^k:"):
            schedule.set_k(m + 1)
        # Forward only (no grad): Colossal-AI's own path, through the same object.
        with torch.no_grad():
            out = schedule.forward_backward_step(model, iter([batch]), criterion, return_loss=True)
        if engine.stage_manager.is_last_stage():
            assert torch.equal(out["loss"], reference[0])
        return {n: p.numel() for n, p in model.unwrap().named_parameters()}
    finally:
        plugin.close()


def _two_ranks(rank, world_size, device):
    # k=3 leaves a short last group; k=4=m is GPipe.
    config = HeteroConfig(parallel=ParallelConfig(pp=2, num_microbatches=4))
    _check_layout(rank, config, [1, 2, 4, 3], controller=True)


def _four_ranks(rank, world_size, device):
    _check_layout(
        rank, HeteroConfig(parallel=ParallelConfig(pp=4, num_microbatches=8)), [1, 2, 3, 8]
    )
    # Two data-parallel pipelines (the plugin all-reduces gradients after the schedule), and
    # the controller agreeing one k over both replicas' rows.
    dp_config = HeteroConfig(parallel=ParallelConfig(pp=2, dp=2, num_microbatches=4))
    _check_layout(rank, dp_config, [2, 4, 1], controller=True)
    # TP=2 inside each stage with uneven shards (3 of 4 heads and 3/4 of the MLP on TP rank 0).
    uneven = {"heads": (3, 1), "ffn": (96, 32)}
    policy = resizable_policy(build_model(GPT2), uneven)
    config = HeteroConfig(parallel=ParallelConfig(tp=2, pp=2, num_microbatches=4))
    sizes = _check_layout(rank, config, [1, 2, 4], policy=policy)
    ffn = [n for n in sizes if n.endswith("mlp.c_fc.weight")]
    assert ffn and all(sizes[n] == 32 * uneven["ffn"][rank % 2] for n in ffn), sizes


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_kfkb_matches_1f1b_exactly_on_two_stages():
    run_distributed(_two_ranks, world_size=2)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kfkb_matches_1f1b_on_four_stages_and_uneven_tp():
    run_distributed(_four_ranks, world_size=4)
