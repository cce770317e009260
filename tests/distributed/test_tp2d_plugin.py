"""parallel.tp_mode 2d through HeteroParallelPlugin and a plain Booster loop (4 gloo ranks, q = 2).

One spawn per test, several plugins one after another, all float64 against the dense
single-process Hugging Face model (same initial weights on every rank):

- GPT-2: the first step's loss and every parameter's gradient (gathered to the full HF tensor
  by the parameter's own gather hook) equal the dense model's; then SGD-with-momentum steps
  (3 by default, 20 in the slow test) follow dense training: every loss, the final weights;
- checkpoints: ``booster.save_model`` (sharded folder and single file) holds full HF tensors
  that plain ``transformers`` loads (``from_pretrained``, ``load_state_dict``) equal to the 2D
  weights bit for bit; a second 2D model loads the folder and the optimizer back exactly (the
  state-dict round trip is the identity, momentum buffers equal bit for bit);
- bad input, each one ValueError on every rank before any collective: tp not a square,
  max_norm, an unsupported model (BERT), heads that do not split evenly, a batch that does not
  split, a padding mask;
- slow test only: Llama (grouped-query attention, untied head, uneven vocabulary) and ViT
  (uneven classes) first steps equal dense; a 1D (tp = 4) model loads the 2D folder and
  optimizer, computes the same loss and its next step (using the loaded momentum) gives the
  dense model's weights; tp 1 x dp 4 (1 x 1 meshes): DDP's averaged gradients equal dense;
  block sizes and placement from a plan (uneven, permuted mesh) through ``convert_to_2d``.

Tolerances: ``chain_atol`` over a transformer's reduction depth in float64 with a magnitude
bound checked on the reference; errors of successive steps add (first order).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from colossalai.booster import Booster
from colossalai.checkpoint_io.utils import gather_distributed_param
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

from colossal_hetero.config import ClusterConfig, HeteroConfig, ParallelConfig
from colossal_hetero.models import loss_from_outputs
from colossal_hetero.planner.tp2d_plan import Resizable2D
from colossal_hetero.plugin import HeteroParallelPlugin
from colossal_hetero.tp2d.convert import convert_to_2d
from colossal_hetero.tp2d.state import spec_of
from tests.dist_utils import run_distributed
from tests.tolerances import chain_atol, transformer_depth, unit_roundoff

DT = torch.float64
V, H, HEADS, LAYERS, SEQ, BATCH = 101, 32, 4, 2, 8, 4  # odd vocabulary: uneven vocab blocks
GPT2_V = 256  # the 1D reload: Colossal-AI pads a vocabulary to a multiple of 64 x tp, and
# neither its loss nor the even optimizer-state split handles the padding at tp 4
STEPS, LR, MOMENTUM = 20, 0.05, 0.9
MAGNITUDE = 50.0  # bound on |loss|, |logits|, |grads| of the reference (checked below)
ATOL = chain_atol(transformer_depth(LAYERS), 4 * H, DT, MAGNITUDE)


def _config(tp_mode: str = "2d", tp: int = 4, **parallel) -> HeteroConfig:
    return HeteroConfig(
        parallel=ParallelConfig(tp=tp, tp_mode=tp_mode, **parallel),
        cluster=ClusterConfig(device="cpu"),
    )


def _gpt2(seed: int = 11, **overrides) -> GPT2LMHeadModel:
    fields = dict(vocab_size=GPT2_V, n_positions=SEQ, n_embd=H, n_layer=LAYERS, n_head=HEADS)
    fields.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **overrides)
    torch.manual_seed(seed)  # the same dense weights on every rank
    return GPT2LMHeadModel(GPT2Config(**fields)).to(DT)


def _llama(seed: int = 13) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,  # grouped-query attention: one kv head per column
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(DT)


def _float64_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _llama_reference() -> LlamaForCausalLM:
    """The dense float64 Llama with its RMSNorms kept in float64 (HF's computes in float32
    whatever the input, which the float64 tolerance would not cover)."""
    model = _llama()
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            eps = module.variance_epsilon
            module.forward = functools.partial(_float64_rms, weight=module.weight, eps=eps)
    return model


def _vit(seed: int = 17) -> ViTForImageClassification:
    config = ViTConfig(
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * H,
        image_size=8,
        patch_size=4,
        num_labels=5,  # odd: uneven class blocks over the mesh columns
    )
    torch.manual_seed(seed)
    return ViTForImageClassification(config).to(DT)


def _images(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(BATCH, 3, 8, 8, generator=g, dtype=DT)
    return {"pixel_values": pixels, "labels": torch.randint(0, 5, (BATCH,), generator=g)}


def _dense_vit_loss(model: ViTForImageClassification, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(pixel_values=batch["pixel_values"]).logits, batch["labels"])


def _batch(step: int, batch: int = BATCH) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, V, (batch, SEQ), generator=g)
    labels = ids.clone()
    labels[step % batch, step % SEQ] = -100  # an ignored token
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _dense_loss(model: GPT2LMHeadModel, batch: dict) -> torch.Tensor:
    """HF's own loss upcasts to float32; the float64 reference shifts and scores by hand."""
    logits = model(input_ids=batch["input_ids"]).logits
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
    return F.cross_entropy(shifted, batch["labels"][:, 1:].reshape(-1))


def _boost(config: HeteroConfig, model):
    plugin = HeteroParallelPlugin(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    booster = Booster(plugin=plugin)
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, loss_from_outputs)
    return plugin, booster, model, optimizer, criterion


def _full(model) -> dict[str, torch.Tensor]:
    """Every parameter gathered to its full HF tensor (collective over the mesh)."""
    return {n: spec_of(p).gather(p) for n, p in model.unwrap().named_parameters()}


def _check_first_step(model_fn, reference_fn, batch: dict, dense_loss) -> None:
    """Loss and every gathered gradient of one step equal the dense model's."""
    reference = reference_fn()
    plugin, booster, model, optimizer, criterion = _boost(_config(), model_fn())
    loss = criterion(model(**batch), batch)
    booster.backward(loss, optimizer)
    ref_loss = dense_loss(reference, batch)
    ref_loss.backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    assert max(ref_loss.abs(), *(g.abs().max() for g in grads.values())) < MAGNITUDE
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=0, atol=ATOL)
    checked = 0
    for name, param in model.unwrap().named_parameters():
        full = spec_of(param).gather(param.grad)
        torch.testing.assert_close(full, grads[name], rtol=0, atol=ATOL, msg=name)
        checked += 1
    assert checked == len(grads)
    plugin.close()


def _check_training(folder: Path, steps: int):
    reference = _gpt2()
    ref_params = dict(reference.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    plugin, booster, model, optimizer, criterion = _boost(_config(), _gpt2())
    names = [n for n, _ in model.unwrap().named_parameters()]
    assert names == [n for n, _ in reference.named_parameters()]  # HF names, HF order
    for step in range(steps):
        batch = _batch(step)
        loss = criterion(model(**batch), batch)
        booster.backward(loss, optimizer)
        ref_loss = _dense_loss(reference, batch)
        ref_loss.backward()
        atol = (step + 1) * ATOL  # first-order errors of each step add
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=0, atol=atol)
        if step == 0:
            grads = [p.grad.abs().max() for p in reference.parameters()]
            assert max(ref_loss.abs(), *grads) < MAGNITUDE  # ATOL's bound holds
            for name, param in model.unwrap().named_parameters():
                full = spec_of(param).gather(param.grad)
                torch.testing.assert_close(full, ref_params[name].grad, rtol=0, atol=ATOL)
        optimizer.step()
        optimizer.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    trained = _full(model)
    for name, full in trained.items():
        torch.testing.assert_close(full, ref_params[name].detach(), rtol=0, atol=steps * ATOL)
    assert (trained["transformer.wte.weight"] - _gpt2().transformer.wte.weight).abs().max() > 1e-3
    booster.save_model(model, str(folder / "sharded"), shard=True)
    booster.save_model(model, str(folder / "model.bin"), shard=False)
    booster.save_optimizer(optimizer, str(folder / "optimizer"))
    states = [dict(optimizer.optim.state[p]) for p in model.unwrap().parameters()]
    loss = criterion(model(**_batch(99)), _batch(99)).detach()
    plugin.close()
    return trained, states, loss, (reference, ref_opt)


def _check_hf_loads(folder: Path, trained: dict) -> None:
    """Plain transformers reads both files: the 2D weights, bit for bit."""
    loaded = GPT2LMHeadModel.from_pretrained(folder / "sharded", torch_dtype=DT)
    for name, param in loaded.named_parameters():
        assert torch.equal(param, trained[name]), name
    fresh = _gpt2(seed=5)
    result = fresh.load_state_dict(torch.load(folder / "model.bin"), strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys
    for name, param in fresh.named_parameters():
        assert torch.equal(param, trained[name]), name


def _check_reload_2d(folder: Path, trained: dict, states: list) -> None:
    plugin, booster, model, optimizer, _ = _boost(_config(), _gpt2(seed=7))
    booster.load_model(model, str(folder / "sharded"))
    booster.load_optimizer(optimizer, str(folder / "optimizer"))
    for name, full in _full(model).items():
        assert torch.equal(full, trained[name]), name
    for param, want in zip(model.unwrap().parameters(), states, strict=True):
        got = optimizer.optim.state[param]
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    module = model.unwrap()  # state_dict (full tensors) -> load_state_dict: the identity
    blocks = {n: p.detach().clone() for n, p in module.named_parameters()}
    module.load_state_dict(module.state_dict())
    assert all(torch.equal(p, blocks[n]) for n, p in module.named_parameters())
    plugin.close()


def _check_reload_1d(folder: Path, loss_2d: torch.Tensor, dense) -> None:
    """A 1D (tp = 4) model loads the 2D folder and optimizer: the same loss, and one more
    step (which uses the loaded momentum) gives the dense model's weights."""
    reference, ref_opt = dense
    plugin, booster, model, optimizer, criterion = _boost(_config("1d"), _gpt2(seed=7))
    booster.load_model(model, str(folder / "sharded"))
    booster.load_optimizer(optimizer, str(folder / "optimizer"))
    probe = _batch(99)
    with torch.no_grad():
        loss = criterion(model(**probe), probe)
    # Colossal-AI's 1D loss sums the exponentials in float32: log-sum-exp off by <= V u32.
    lse_atol = GPT2_V * unit_roundoff(torch.float32)
    torch.testing.assert_close(loss, loss_2d, rtol=0, atol=ATOL + lse_atol)
    batch = _batch(50)
    booster.backward(criterion(model(**batch), batch), optimizer)
    optimizer.step()
    _dense_loss(reference, batch).backward()
    ref_opt.step()
    # The weights moved by lr * (momentum + gradient); the gradient inherits the loss's
    # float32 rounding (relative <= V u32 of gradients bounded by MAGNITUDE).
    atol = (STEPS + 1) * ATOL + LR * lse_atol * MAGNITUDE
    momentum = max(float(ref_opt.state[p]["momentum_buffer"].abs().max()) for p in ref_opt.state)
    assert LR * MOMENTUM * momentum > 100 * atol  # a lost momentum would show
    ref_params = dict(reference.named_parameters())
    for name, param in model.unwrap().named_parameters():
        full = gather_distributed_param(param)
        torch.testing.assert_close(full, ref_params[name].detach(), rtol=0, atol=atol, msg=name)
    plugin.close()


def _check_dp_around_meshes(rank: int) -> None:
    """tp 1 and dp 4 (a 1 x 1 mesh per rank): Colossal-AI's DDP over the data-parallel group
    averages the 2D parameters' gradients over the replicas, as the dense mean of their
    losses gives them."""
    reference = _gpt2()
    plugin, booster, model, optimizer, criterion = _boost(_config(tp=1), _gpt2())
    whole = _batch(7, batch=8)
    shards = [{k: v[2 * r : 2 * r + 2] for k, v in whole.items()} for r in range(4)]
    loss = criterion(model(**shards[rank]), shards[rank])
    booster.backward(loss, optimizer)
    ref_loss = sum(_dense_loss(reference, shard) for shard in shards) / 4
    ref_loss.backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, param in model.unwrap().named_parameters():
        full = spec_of(param).gather(param.grad)
        torch.testing.assert_close(full, grads[name], rtol=0, atol=ATOL, msg=name)
    plugin.close()


def _check_planned_uneven() -> None:
    """Block sizes and placement from a plan (``plan.tp2d``, here the planner's Resizable2D):
    uneven batch (3, 1), heads (3, 1), MLP (96, 32), vocabulary, on a permuted mesh; the
    converted GPT-2's loss and gradients still equal the dense model's."""
    positions = (1, 3, 2, 0)  # rank 1 at (0, 0), rank 3 at (0, 1), ...
    sizes = Resizable2D(positions, (3, 1), (3, 1), (96, 32), (200, 56), 1.0, 1.0, True)
    reference = _gpt2()
    world = dist.group.WORLD
    model = convert_to_2d(_gpt2(), world, SimpleNamespace(tp2d=sizes))
    assert (model.mesh.i, model.mesh.j) == divmod(positions.index(dist.get_rank()), 2)
    batch = _batch(3)
    loss = model(**batch).loss
    loss.backward()
    ref_loss = _dense_loss(reference, batch)
    ref_loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=0, atol=ATOL)
    grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, param in model.named_parameters():
        full = spec_of(param).gather(param.grad)
        torch.testing.assert_close(full, grads[name], rtol=0, atol=ATOL, msg=name)
    _expect_error("does not match the plan's 2D batch shares", lambda: model(**_batch(0, 2)))


def _expect_error(match: str, action) -> None:
    with pytest.raises(ValueError, match=match):
        action()


def _check_bad_input() -> None:
    _expect_error(
        "parallel.tp: 2D tensor parallelism needs a square", lambda: _boost(_config(tp=2), _gpt2())
    )
    _expect_error("parallel.max_norm", lambda: _boost(_config(max_norm=1.0), _gpt2()))
    plugin = HeteroParallelPlugin(_config())
    booster = Booster(plugin=plugin)
    bert = BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4))
    _expect_error("model.arch: .*got 'bert'", lambda: booster.boost(bert))
    _expect_error("model.hf.n_head: 3 heads", lambda: booster.boost(_gpt2(n_embd=48, n_head=3)))
    plugin.close()
    plugin, booster, model, _, _ = _boost(_config(), _gpt2())
    _expect_error("batch of 3 samples is not divisible", lambda: model(**_batch(0, batch=3)))
    padded = _batch(0)
    padded["attention_mask"][0, -1] = 0
    _expect_error("attention_mask must be all ones", lambda: model(**padded))
    dist.barrier()  # every rank raised and nobody is left in a collective
    plugin.close()


def _run(rank: int, world_size: int, device: torch.device, folder: str, full: bool) -> None:
    path = Path(folder)
    if full:
        _check_first_step(_llama, _llama_reference, _batch(0), _dense_loss)
        _check_first_step(_vit, _vit, _images(), _dense_vit_loss)
    trained, states, loss, dense = _check_training(path, STEPS if full else 3)
    if rank == 0:
        _check_hf_loads(path, trained)
    dist.barrier()
    _check_reload_2d(path, trained, states)
    from tests.distributed.test_tp2d_planned import check_planned_2d, check_planned_llama_2d

    check_planned_2d(rank, world_size)  # plan.tp2d from the planner (unequal devices)
    check_planned_llama_2d(rank)  # the same for Llama (heads in whole key/value groups)
    if full:
        _check_reload_1d(path, loss, dense)
        _check_dp_around_meshes(rank)
        _check_planned_uneven()
    _check_bad_input()


def test_gpt2_2d_through_the_plugin() -> None:
    """GPT-2: first-step gradients, 3 steps, checkpoints into HF and back into 2D, bad input."""
    with tempfile.TemporaryDirectory() as folder:
        run_distributed(_run, 4, folder=folder, full=False, force_cpu=True)


@pytest.mark.slow
def test_gpt2_llama_vit_2d_20_steps_and_1d_reload() -> None:
    """Everything: Llama and ViT too, 20 steps, the 1D reload of model and optimizer, data
    parallelism around 1 x 1 meshes."""
    with tempfile.TemporaryDirectory() as folder:
        run_distributed(_run, 4, folder=folder, full=True, force_cpu=True)
