"""Mixtral through HeteroParallelPlugin with parallel.ep: EP=2 on 2 gloo ranks (default), and
EP=2 x DP=2 on 4, contiguous and with an uneven placement (slow), one spawn each.

A plain Booster loop trains a tiny ``MixtralForCausalLM`` (4 experts, top-2, router aux loss
on) in fp32 with our expert-parallel block and chunked reducers; every rank also holds a
single-process copy of the same model (EP=1, the independent reference). Rank j trains on
shard j of one global batch; the reference computes each shard's loss (language-model loss
plus the aux loss, as Hugging Face defines it per forward) and backpropagates their mean.

Three steps, each a routing case with a priority setting (a forward hook adds a per-shard
bias of +-8 to the router logits, on both models alike):
- ``even`` (priority on): the model's own routing;
- ``skewed`` (priority off): every shard prefers other experts, expert 3 gets no token;
- ``zero`` (priority on): every token goes to experts 0 and 1, so ep rank 1 (ranks 1 and 3,
  experts 2 and 3) receives no token at all and issues both a2a's with empty tensors.
Checks per step:
- forward: rank j's loss equals the reference's loss on shard j;
- after the flush every gradient this rank holds (dense, and its experts') equals the
  reference's (the mean over shards); experts without tokens anywhere have zero gradients;
- priority on: no chunk launched inside an a2a call or a pending span (dispatch to combine);
  priority off: some chunk does launch inside a pending span (the gate is what held them);
- at most ``max_inflight`` chunks per group in flight;
- the gradient collective sequence is identical on the ranks of each group, and every rank
  issued the same number of a2a's (no hang: the test has a time limit);
- ``zero``: on ranks no token reaches, expert chunks launch before the last a2a (their zero
  gradients are known from the routing counts in forward, not only at the flush);
- after the SGD step the parameters equal the reference's after the same step.
Tolerance: ``chain_atol`` over the transformer's reduction chain (tests/tolerances.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from colossal_hetero.moe.comm import chunks_inside
from tests.dist_utils import run_distributed
from tests.tolerances import chain_atol, transformer_depth

LAYERS, HIDDEN, FFN, EXPERTS, SEQ, PER_RANK, LR = 2, 16, 32, 4, 8, 2, 0.1
K_MAX = max(HIDDEN, FFN, SEQ * PER_RANK * 4, 256)  # longest sum: the LM head over the vocab
CASES = (("even", True, None), ("skewed", False, "skewed"), ("zero", True, "zero"))


def _bias(case: str | None, shard: int) -> torch.Tensor:
    if case is None:
        return torch.zeros(EXPERTS)
    if case == "zero":
        return torch.tensor([8.0, 8.0, -8.0, -8.0])
    prefs = ([8, 8, -8, -8], [8, -8, 8, -8], [-8, 8, 8, -8], [8, 8, -8, -8])
    return torch.tensor(prefs[shard], dtype=torch.float32)


def _model():  # type: ignore[no-untyped-def]
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=256,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        output_router_logits=True,
        router_aux_loss_coef=0.05,
    )
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def _gates(model):  # type: ignore[no-untyped-def]
    return [layer.block_sparse_moe.gate for layer in model.model.layers]


def _check(  # type: ignore[no-untyped-def]
    rank: int,
    world_size: int,
    device: torch.device,
    placement: list | None = None,
    pipeline=1,
    auto=False,
) -> None:
    from colossalai.booster import Booster

    from colossal_hetero.config.moe import MoeConfig
    from colossal_hetero.config.parallel import ParallelConfig
    from colossal_hetero.config.schema import HeteroConfig
    from colossal_hetero.plugin import HeteroParallelPlugin

    # fit_gaps off: the strict span gate is checked here; the windows in test_moe_scheduler.
    moe = MoeConfig(
        chunk_kib=1,
        placement=placement or [],
        fit_gaps=False,
        pipeline_chunks=pipeline,
        pipeline_auto=False,  # exactly `pipeline` ranges (the choice: test_moe_pipeline_choice)
        chunk_auto=auto,
    )
    config = HeteroConfig(parallel=ParallelConfig(ep=2), moe=moe)
    held = (placement or [[0, 1], [2, 3]])[rank % 2]
    plugin = HeteroParallelPlugin(config)
    model = _model()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    if auto:
        _check_auto_chunks(plugin.moe_reducers)
    inner = model.unwrap()
    bias = [torch.zeros(EXPERTS)]
    for gate in _gates(inner) + _gates(reference):
        gate.register_forward_hook(lambda m, i, out: out + bias[0])
    generator = torch.Generator().manual_seed(1)
    for case, priority, skew in CASES:
        for reducer in plugin.moe_reducers.values():
            reducer.priority = priority
        batch = torch.randint(0, 256, (world_size * PER_RANK, SEQ), generator=generator)
        shards = batch.split(PER_RANK)
        ref_losses = _reference_step(reference, shards, skew, bias)
        bias[0] = _bias(skew, rank)
        loss = model(input_ids=shards[rank], labels=shards[rank]).loss
        booster.backward(loss, optimizer)
        for reducer in plugin.moe_reducers.values():
            reducer.flush()
        depth = transformer_depth(LAYERS) + 4  # + router softmax, top-k weights, two a2a's
        forward = transformer_depth(LAYERS, backward=False) + 2
        tol = chain_atol(forward, K_MAX, torch.float32, abs(ref_losses[rank]))
        assert abs(float(loss) - ref_losses[rank]) <= tol, (case, float(loss), ref_losses[rank])
        _compare_grads(inner, reference, case, depth)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():  # the same SGD step on the reference
            for p in reference.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)
        log = plugin.moe_log.last
        if pipeline > 1:  # per layer: counts, n dispatches, n combines; 2n in backward
            assert sum(1 for k, *_ in log if k == "a2a") == LAYERS * (1 + 4 * pipeline), case
        _check_log(log, case, priority, max_inflight=config.moe.max_inflight)
        _check_gate_mattered(log, case, priority)
        if case == "zero" and min(held) > 1:  # no token reaches this rank's experts: their
            # zero gradients are known in forward, so their chunks go before backward ends
            first_expert = min(r[3] for r in log if r[0] == "chunk" and r[1] == "expert")
            assert first_expert < max(r[3] for r in log if r[0] == "a2a"), case
        _check_sequences(plugin, log, rank, world_size, case)
    _compare_params(inner, reference)
    plugin.close()


def _check_auto_chunks(reducers) -> None:  # type: ignore[no-untyped-def]
    """moe.chunk_auto reached the reducers: each group's chunks are choose_chunk_bytes' size
    from its own agreed profile (1 KiB both bounds here: the fewest chunks of at most 1 KiB,
    ceil(total / 1 KiB) of them; a fixed chunk_kib evens into floor(total / 1 KiB) instead)."""
    from colossal_hetero.moe.chunks import choose_chunk_bytes

    for name, reducer in reducers.items():
        total = sum(c.numel for c in reducer.chunks) * 4  # fp32
        size = choose_chunk_bytes(
            total, *reducer.profile, itemsize=4, min_bytes=1024, max_bytes=1024
        )
        assert len(reducer.chunks) == -(-total // size), (name, len(reducer.chunks), total)
        assert max(c.numel for c in reducer.chunks) * 4 <= size, name


def _reference_step(reference, shards, skew: str | None, bias: list) -> list[float]:  # type: ignore[no-untyped-def]
    """Backward of the mean of the shards' losses on the reference; returns each shard's loss."""
    losses = []
    reference.zero_grad(set_to_none=True)
    for j, shard in enumerate(shards):
        bias[0] = _bias(skew, j)
        loss = reference(input_ids=shard, labels=shard).loss
        (loss / len(shards)).backward()
        losses.append(float(loss))
    return losses


def _compare_params(inner, reference) -> None:  # type: ignore[no-untyped-def]
    refs = dict(reference.named_parameters())
    for name, p in inner.named_parameters():
        scale = float(refs[name].abs().max())
        atol = chain_atol(transformer_depth(LAYERS) + 4, K_MAX, torch.float32, scale)
        torch.testing.assert_close(p, refs[name], rtol=0, atol=atol, msg=name)


def _compare_grads(inner, reference, case: str, depth: int) -> None:  # type: ignore[no-untyped-def]
    refs = dict(reference.named_parameters())
    compared = 0
    for name, p in inner.named_parameters():
        ref = refs[name].grad
        ref = torch.zeros_like(refs[name]) if ref is None else ref
        assert p.grad is not None, (case, name)
        scale = max(float(ref.abs().max()), 1e-3)
        atol = chain_atol(depth, K_MAX, torch.float32, scale)
        torch.testing.assert_close(p.grad, ref, rtol=0, atol=atol, msg=f"{case}: {name}")
        no_tokens = {"zero": (".experts.2.", ".experts.3."), "skewed": (".experts.3.",)}
        if any(part in name for part in no_tokens.get(case, ())):
            assert torch.count_nonzero(p.grad) == 0, (case, name)  # zero-filled, reduced
        compared += 1
    assert compared > 0


def _check_log(log, case: str, priority: bool, max_inflight: int) -> None:  # type: ignore[no-untyped-def]
    assert any(k == "chunk" for k, *_ in log) and any(k == "a2a" for k, *_ in log), case
    if priority:
        assert chunks_inside(log, "a2a") == 0, case
        assert chunks_inside(log, "pending") == 0, case
    for group in ("dense", "expert"):
        chunks = [(a, b) for k, g, _, a, b, _ in log if k == "chunk" and g == group]
        for t, _ in chunks:
            assert sum(1 for a, b in chunks if a <= t < b) <= max_inflight, (case, group)


def _check_gate_mattered(log, case: str, priority: bool) -> None:  # type: ignore[no-untyped-def]
    """Priority off: some rank launches a chunk inside a pending span (so the gate is what held
    them back when on). Not every rank need: a rank whose last expert got no token has its
    first expert chunk ready only at the flush, and chunks go strictly in order."""
    inside = torch.tensor([chunks_inside(log, "pending")])
    dist.all_reduce(inside, op=dist.ReduceOp.MAX)
    assert (int(inside) > 0) == (not priority), (case, int(inside))


def _check_sequences(plugin, log, rank: int, world_size: int, case: str) -> None:  # type: ignore[no-untyped-def]
    mine: dict = {
        "dense": list(plugin.moe_reducers["dense"].collectives),
        "expert": list(plugin.moe_reducers["expert"].collectives),
        "a2a": sum(1 for k, *_ in log if k == "a2a"),
    }
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    assert all(other["dense"] == mine["dense"] for other in everyone), case
    assert all(other["a2a"] == mine["a2a"] for other in everyone), case
    replicas = [everyone[r] for r in range(world_size) if r % 2 == rank % 2]
    assert all(other["expert"] == mine["expert"] for other in replicas), case
    assert len(mine["dense"]) > 1 and len(mine["expert"]) > 1, case


@pytest.mark.timeout(300)
def test_mixtral_ep2_matches_single_process() -> None:
    """EP=2 on 2 ranks (the expert groups are single ranks): the default suite's spawn."""
    run_distributed(_check, 2, force_cpu=True)


@pytest.mark.timeout(300)
def test_mixtral_ep2_pipelined_matches_single_process() -> None:
    """EP=2 on 2 ranks with a2a/expert pipelining over 3 token ranges (moe.pipeline_chunks):
    the same checks, every a2a of every range gated and issued by both ranks; chunk sizes from
    the measured profile (moe.chunk_auto)."""
    run_distributed(_check, 2, force_cpu=True, pipeline=3, auto=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mixtral_ep2_dp2_matches_single_process() -> None:
    """EP=2 x DP=2 on 4 ranks: expert gradients reduced over their replicas too."""
    run_distributed(_check, 4, force_cpu=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mixtral_uneven_placement_matches_single_process() -> None:
    """EP=2 x DP=2 with moe.placement [[3], [0, 1, 2]]: one expert on ep rank 0, three on
    ep rank 1, not in Colossal-AI's contiguous order."""
    run_distributed(_check, 4, force_cpu=True, placement=[[3], [0, 1, 2]])
