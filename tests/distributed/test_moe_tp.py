"""Tensor parallelism around expert parallelism: EP=2 x TP=2 on 4 gloo ranks (dp 2, moe_dp 1),
with pipelining, with packing, and on 8 ranks (dp 4, moe_dp 2); one spawn each (the last three
slow).

Colossal-AI's mesh numbers rank ``e * 2 + t`` (ep index ``e``, tp index ``t``): ranks 0 and 1
are the tp pair of data-parallel rank 0, ranks 2 and 3 of data-parallel rank 1; ep groups are
{0, 2} and {1, 3}. Attention, embeddings, the router and the LM head are split by
Colossal-AI's Mixtral policy, each held expert by our block (w1/w3 by columns, w2 by rows).

A plain Booster loop trains a tiny ``MixtralForCausalLM`` (4 experts, top-2, router aux loss)
in fp32 with clipping on; every rank also holds a single-process copy (EP=1, TP=1: the
independent reference), which backpropagates the mean of the data-parallel shards' losses.
Two steps: the model's own routing, then ``zero`` (a router bias sends every token to experts
0 and 1, so ep rank 1 -- ranks 2 and 3 -- receives no token and issues empty a2a's). Checks:
- the loss equals the reference's on this rank's shard;
- after the flush every gradient (tp shards gathered to the full shape) equals the reference's;
  ``zero``: experts 2 and 3 have zero gradients;
- the clipping norm (moe/clip.py) equals the reference's global norm, and its norm over only
  the replicated, only the dense-shard and only the expert gradients the reference's over the
  same parameters (each counted once); the clipped SGD step gives the reference's weights;
- every rank issued the same number of a2a's, each gradient group's ranks the same collective
  sequence (no hang: the spawn has a time limit).
Tolerance: ``chain_atol`` over the transformer's reduction chain (tests/tolerances.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.distributed.test_moe_plugin import _model  # the same tiny Mixtral (vocab 256)
from tests.tolerances import chain_atol, transformer_depth

LAYERS, HIDDEN, FFN, EXPERTS, SEQ, PER_RANK, LR, TP = 2, 16, 32, 4, 8, 2, 0.1, 2
VOCAB = 256  # a multiple of 64 * TP: the vocab-parallel embedding adds no padding rows
K_MAX = max(HIDDEN, FFN, SEQ * PER_RANK * 4, VOCAB)  # up to 4 data-parallel shards
MAX_NORM = 0.5  # below the gradients' norm (about 1-2 here): the step really clips


def _full(local: torch.Tensor, shape: torch.Size, group) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """``local`` gathered over the tp ``group`` along the one dim where it is shorter than
    ``shape`` (a replicated tensor is returned as it is)."""
    dims = [d for d in range(local.dim()) if local.shape[d] != shape[d]]
    if not dims:
        return local
    assert len(dims) == 1 and local.shape[dims[0]] * TP == shape[dims[0]], (local.shape, shape)
    parts = [torch.empty_like(local) for _ in range(TP)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=dims[0])


def _check(
    rank: int, world_size: int, device: torch.device, packing: bool = False, pipeline: int = 1
) -> None:
    from colossalai.booster import Booster

    from colossal_hetero.config.moe import MoeConfig
    from colossal_hetero.config.parallel import ParallelConfig
    from colossal_hetero.config.schema import HeteroConfig
    from colossal_hetero.plugin import HeteroParallelPlugin

    parallel = ParallelConfig(ep=2, tp=TP, max_norm=MAX_NORM)
    moe = MoeConfig(
        chunk_kib=1,
        fit_gaps=False,
        packing=packing,
        pipeline_chunks=pipeline,
        pipeline_auto=False,  # exactly `pipeline` token ranges
    )
    config = HeteroConfig(parallel=parallel, moe=moe)
    plugin = HeteroParallelPlugin(config)
    tp_group = plugin.engine.tp_group
    model = _model()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    inner = model.unwrap()
    blocks = [layer.block_sparse_moe for layer in inner.model.layers]
    assert all(b.packing == packing and b.pipeline_chunks == pipeline for b in blocks)
    bias = [torch.zeros(EXPERTS)]
    for net in (inner, reference):
        for layer in net.model.layers:
            layer.block_sparse_moe.gate.register_forward_hook(lambda m, i, out: out + bias[0])
    generator = torch.Generator().manual_seed(1)
    shard_index = rank // TP  # the data-parallel rank
    for case, skew in (("even", None), ("zero", torch.tensor([8.0, 8.0, -8.0, -8.0]))):
        bias[0] = torch.zeros(EXPERTS) if skew is None else skew
        batch = torch.randint(0, VOCAB, (world_size // TP * PER_RANK, SEQ), generator=generator)
        shards = batch.split(PER_RANK)
        ref_losses = _reference_backward(reference, shards)
        loss = model(input_ids=shards[shard_index], labels=shards[shard_index]).loss
        booster.backward(loss, optimizer)
        for reducer in plugin.moe_reducers.values():
            reducer.flush()
        forward = transformer_depth(LAYERS, backward=False) + 2
        tol = chain_atol(forward, K_MAX, torch.float32, abs(ref_losses[shard_index]))
        assert abs(float(loss) - ref_losses[shard_index]) <= tol, (case, float(loss))
        depth = transformer_depth(LAYERS) + 4  # + router softmax, top-k weights, two a2a's
        _compare_grads(inner, reference, case, depth, tp_group)
        _check_norm_parts(optimizer, inner, reference, depth)
        ref_norm = _clip_reference(reference)
        optimizer.step()  # flushes (nothing left), clips by moe/clip.py's norm, steps
        norm = float(optimizer._current_grad_norm)
        assert abs(norm - ref_norm) <= chain_atol(depth, K_MAX, torch.float32, ref_norm), case
        optimizer.zero_grad()
        _check_sequences(plugin, rank, world_size, case)
        if pipeline > 1:  # per layer: counts, n dispatches, n combines; 2n in backward
            a2a = sum(1 for k, *_ in plugin.moe_log.last if k == "a2a")
            assert a2a == LAYERS * (1 + 4 * pipeline), (case, a2a)
    _compare_params(inner, reference, tp_group)
    plugin.close()


def _reference_backward(reference, shards) -> list[float]:  # type: ignore[no-untyped-def]
    """Backward of the mean of the shards' losses; returns each shard's loss."""
    reference.zero_grad(set_to_none=True)
    losses = []
    for shard in shards:
        loss = reference(input_ids=shard, labels=shard).loss
        (loss / len(shards)).backward()
        losses.append(float(loss))
    return losses


def _clip_reference(reference) -> float:  # type: ignore[no-untyped-def]
    """The reference's global gradient norm, then its clipped SGD step (as the wrapper does:
    ``max_norm / (norm + 1e-6)``, capped at 1)."""
    grads = [p.grad for p in reference.parameters() if p.grad is not None]
    norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
    scale = min(1.0, MAX_NORM / (norm + 1e-6))
    assert scale < 1.0, norm  # the step does clip
    with torch.no_grad():
        for p in reference.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-LR * scale)
    return norm


def _compare_grads(inner, reference, case: str, depth: int, tp_group) -> None:  # type: ignore[no-untyped-def]
    refs = dict(reference.named_parameters())
    compared = set()
    for name, p in inner.named_parameters():
        ref = refs[name].grad
        ref = torch.zeros_like(refs[name]) if ref is None else ref
        assert p.grad is not None, (case, name)
        if ".experts." in name or "self_attn.q_proj" in name:  # split over the tp pair
            assert p.shape != ref.shape, (name, p.shape)
        grad = _full(p.grad, ref.shape, tp_group)
        scale = max(float(ref.abs().max()), 1e-3)
        atol = chain_atol(depth, K_MAX, torch.float32, scale)
        torch.testing.assert_close(grad, ref, rtol=0, atol=atol, msg=f"{case}: {name}")
        if case == "zero" and (".experts.2." in name or ".experts.3." in name):
            assert torch.count_nonzero(grad) == 0, (case, name)
        compared.add(name)
    held = (0, 1) if dist.get_rank() // TP % 2 == 0 else (2, 3)  # ep index 0 or 1
    for name in refs:  # every dense parameter and every held expert's were compared
        expert = next((e for e in range(EXPERTS) if f".experts.{e}." in name), None)
        assert name in compared or expert not in held, (case, name)


def _check_norm_parts(optimizer, inner, reference, depth: int) -> None:  # type: ignore[no-untyped-def]
    """The installed norm over each kind of parameter alone equals the reference's over the
    same parameters: replicated over the tp pair (the norms: 1.5e-4 of the whole squared
    norm here, so only a part's norm can show them counted twice), dense tp shards, experts."""
    from colossalai.tensor.d_tensor import is_distributed_tensor

    refs, mine = dict(reference.named_parameters()), dict(inner.named_parameters())
    parts = {
        "replicated": lambda n, p: not is_distributed_tensor(p) and ".experts." not in n,
        "dense shards": lambda n, p: is_distributed_tensor(p) and ".experts." not in n,
        "experts": lambda n, p: ".experts." in n,
    }
    for part, wanted in parts.items():
        pairs = [(p, p.grad) for n, p in mine.items() if wanted(n, p)]
        norm = optimizer._compute_grad_norm(pairs)  # collective: every rank, same order
        keep = {
            n for n, p in refs.items() if wanted(n, mine.get(n, p))
        }  # experts held elsewhere too
        ref = float(torch.sqrt(sum(refs[n].grad.double().pow(2).sum() for n in keep)))
        assert ref > 0, part
        assert abs(norm - ref) <= chain_atol(depth, K_MAX, torch.float32, ref), (part, norm, ref)


def _compare_params(inner, reference, tp_group) -> None:  # type: ignore[no-untyped-def]
    refs = dict(reference.named_parameters())
    for name, p in inner.named_parameters():
        scale = float(refs[name].abs().max())
        atol = chain_atol(transformer_depth(LAYERS) + 4, K_MAX, torch.float32, scale)
        full = _full(p.detach(), refs[name].shape, tp_group)
        torch.testing.assert_close(full, refs[name], rtol=0, atol=atol, msg=name)


def _check_sequences(plugin, rank: int, world_size: int, case: str) -> None:  # type: ignore[no-untyped-def]
    log = plugin.moe_log.last
    mine: dict = {
        "dense": list(plugin.moe_reducers["dense"].collectives),
        "expert": list(plugin.moe_reducers["expert"].collectives),
        "a2a": sum(1 for k, *_ in log if k == "a2a"),
    }
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    assert mine["a2a"] >= 4 * LAYERS, case  # dispatch and combine, forward and backward
    assert all(other["a2a"] == mine["a2a"] for other in everyone), case
    same_shard = [everyone[r] for r in range(world_size) if r % TP == rank % TP]
    assert all(other["dense"] == mine["dense"] for other in same_shard), case
    replicas = [o for r, o in enumerate(everyone) if r % (2 * TP) == rank % (2 * TP)]
    assert all(other["expert"] == mine["expert"] for other in replicas), case  # moe_dp
    assert len(mine["dense"]) > 1 and len(mine["expert"]) > 1, case


# Default suite: 21 s wall at load 12.8 on 2 cores (30 s of CPU over the 4 ranks).
@pytest.mark.timeout(300)
def test_mixtral_ep2_tp2_matches_single_process() -> None:
    """EP=2 x TP=2 on 4 ranks: loss, gathered gradients, clipping norm and the clipped step
    equal a single-process Mixtral, with zero-token routing on one ep rank."""
    run_distributed(_check, 4, force_cpu=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mixtral_ep2_tp2_pipelined_matches_single_process() -> None:
    """The same with a2a/expert pipelining over 3 token ranges (moe.pipeline_chunks): each
    range's expert slices and their tp all-reduces run between that range's a2a's."""
    run_distributed(_check, 4, force_cpu=True, pipeline=3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mixtral_ep2_tp2_packed_matches_single_process() -> None:
    """The same with expert packing (moe.packing): one row per (token, ep rank), combined
    there, through tp-split experts."""
    run_distributed(_check, 4, force_cpu=True, packing=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mixtral_ep2_tp2_dp4_matches_single_process() -> None:
    """EP=2 x TP=2 on 8 ranks (dp 4, moe_dp 2): each tp slice of an expert is also reduced
    over its replica (ranks r and r + 4)."""
    run_distributed(_check, 8, force_cpu=True)
