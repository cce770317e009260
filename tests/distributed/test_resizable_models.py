"""Whole GPT-2 and Llama models with uneven TP widths match the single-process model.

Through HeteroParallelPlugin(config, policy=resizable policy) on 2 ranks (TP=2), with uneven
heads, MLP and vocabulary widths, one rank holding far more than the other:

- one SGD step: the loss equals the reference loss and every gradient, read from the gathered
  state dict as (before - after) / LR, equals the reference gradient (as test_parity.py);
- 20 Adam steps learn, each step's loss equal to the dense model's at the same weights;
- a checkpoint saved with booster.save_model at one set of widths loads exactly into other
  widths and into TP=1, and into plain transformers (the file holds a standard HF state dict);
- resizing between steps (and between backward and step, so gradients move too) continues
  training exactly as stopping there and restarting at the new widths from the full state.

Tolerances (fp32, tests/tolerances.py): parallel and reference differ only in summation order
(TP all-reduces, the split vocabulary's log-sum-exp): gradients within the reduction chain's
bound (transformer_depth(2) reductions of at most K_MAX terms) of the model's largest
gradient, plus reading them back from the SGD update; losses within the forward chain's bound
of the loss. Training is compared one step at a time from the same weights (Adam amplifies
rounding noise on near-zero gradients into O(lr) weight differences, so whole trajectories
that sum in different orders have no useful bound). Checkpoints and resizing move values
without arithmetic: bitwise, against a reference that runs the same kernels on the same shapes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from colossalai.booster import Booster

from colossal_hetero.config import HeteroConfig, ModelConfig, ParallelConfig
from colossal_hetero.models import build_hf_config, build_model, loss_from_outputs
from colossal_hetero.plugin import HeteroParallelPlugin, prepare_device
from colossal_hetero.policies import resizable_policy
from tests.dist_utils import run_distributed
from tests.restart import gather_full, load_full
from tests.tiny_models import GPT2, LLAMA
from tests.tolerances import chain_atol, grad_from_update_atol, transformer_depth

LR = 0.5
ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
K_MAX = 320  # longest sum: BERT's 320-entry vocabulary (hidden <= 96, tokens per batch 64)
FORWARD_RTOL = chain_atol(transformer_depth(2, backward=False), K_MAX, torch.float32, 1.0)
GRAD_RTOL = chain_atol(transformer_depth(2), K_MAX, torch.float32, 1.0)  # x largest grad
BERT = ModelConfig(
    arch="bert",
    hf={
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "max_position_embeddings": 32,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    },
)
VIT = ModelConfig(
    arch="vit",
    hf={
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    },
)
GPT2_WIDTHS = {"heads": (3, 1), "ffn": (80, 16), "vocab": (200, 56)}
LLAMA_WIDTHS = {"heads": (2, 4), "ffn": (0, 64), "vocab": (31, 225)}  # a zero-width MLP shard
# Zero-width attention shards: one rank holds no heads (policies/zero_heads.py).
GPT2_NO_HEADS = {"heads": (0, 4), "ffn": (80, 16), "vocab": (200, 56)}
LLAMA_NO_HEADS = {"heads": (6, 0), "ffn": (16, 48), "vocab": (31, 225)}


def _batch(
    step: int = 0, batch_size: int = 4, seq_len: int = 16, learnable: bool = False
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    if learnable:  # next token = previous + 37 (mod 256): a bigram rule over the whole vocabulary
        starts = torch.randint(0, 256, (batch_size, 1), generator=generator)
        ids = (starts + 37 * torch.arange(seq_len)) % 256
    else:
        ids = torch.randint(0, 256, (batch_size, seq_len), generator=generator)
    labels = ids.clone()
    labels[:, :3] = -100  # some ignored tokens: the loss must average over the others only
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


class _Run:
    """A model boosted with uneven TP=2 (or ``tp``), its optimizer and policy."""

    def __init__(self, model_cfg, widths, *, optimizer="sgd", tp=2, pp=1, precision="fp32"):
        self.policy = resizable_policy(build_model(model_cfg), widths) if tp > 1 else None
        parallel = ParallelConfig(
            tp=tp, pp=pp, num_microbatches=2 if pp > 1 else 1, precision=precision
        )
        self.plugin = HeteroParallelPlugin(HeteroConfig(parallel=parallel), policy=self.policy)
        model = build_model(model_cfg)
        self.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        optim = (
            torch.optim.SGD(model.parameters(), lr=LR)
            if optimizer == "sgd"
            else torch.optim.Adam(model.parameters(), lr=1e-2)
        )
        self.booster = Booster(plugin=self.plugin)
        self.model, self.optimizer, self.criterion, _, _ = self.booster.boost(
            model, optim, loss_from_outputs
        )

    def pipeline_step(self, batch) -> float | None:
        """One pipelined SGD step; the loss on the last stage, None elsewhere."""
        result = self.booster.execute_pipeline(
            iter([batch]), self.model, self.criterion, self.optimizer, return_loss=True
        )
        self.optimizer.step()
        self.optimizer.zero_grad()
        return None if result["loss"] is None else float(result["loss"])

    def backward(self, batch) -> float:
        loss = self.criterion(self.model(**batch), batch)
        self.booster.backward(loss, self.optimizer)
        return float(loss)

    def step(self, batch) -> float:
        loss = self.backward(batch)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    def state(self) -> dict[str, torch.Tensor]:
        """The full HF state dict (gathered from the shards by the checkpoint hooks)."""
        return {k: v.detach().clone() for k, v in self.model.unwrap().state_dict().items()}

    def close(self):
        self.plugin.close()


def _reference_grads(model_cfg, batch):
    model = build_model(model_cfg)
    loss = model(**batch).loss
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    # Tied weights appear once in named_parameters; the state dict names every alias.
    by_storage = {p.data_ptr(): p.grad for p in model.parameters()}
    for name, tensor in model.state_dict().items():
        if name not in grads and tensor.data_ptr() in by_storage:
            grads[name] = by_storage[tensor.data_ptr()]
    return float(loss), grads


def _mlm_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 320, (4, 16), generator=generator)
    labels = torch.full_like(ids, -100)
    masked = torch.rand(ids.shape, generator=generator) < 0.3
    labels[masked], ids[masked] = ids[masked], 256  # byte ids, 256 = the mask id
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _image_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    return {
        "pixel_values": torch.randn(4, 1, 8, 8, generator=generator),
        "labels": torch.randint(0, 10, (4,), generator=generator),
    }


def _check_parity(model_cfg, widths, batch=None):
    batch = _batch() if batch is None else batch
    ref_loss, ref_grads = _reference_grads(model_cfg, batch)
    run = _Run(model_cfg, widths)
    try:
        before = run.state()
        loss = run.step(batch)
        after = run.state()
    finally:
        run.close()
    assert abs(loss - ref_loss) <= FORWARD_RTOL * abs(ref_loss), f"loss {loss} vs {ref_loss}"
    assert set(after) >= set(ref_grads)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, expected in ref_grads.items():
        grad = (before[name] - after[name]) / LR
        atol = _grad_atol(scale, before[name], after[name])
        torch.testing.assert_close(grad, expected, rtol=0, atol=atol, msg=name)


def _grad_atol(scale, before, after) -> float:
    """Summation order (the chain, scaled by the model's largest gradient: the terms of a sum
    that cancels, such as the key bias's exactly zero gradient, are that large) plus reading
    the gradient back from the SGD update (rounding of the largest weight before or after)."""
    weight_scale = float(torch.maximum(before.abs(), after.abs()).max())
    return GRAD_RTOL * scale + grad_from_update_atol(LR, torch.float32, weight_scale)


def _check_checkpoint(model_cfg, widths, other_widths, folder, rank):
    path = os.path.join(folder, f"{model_cfg.arch}.pt")
    run = _Run(model_cfg, widths)
    try:
        run.step(_batch(1))  # trained weights, not the initial ones
        run.booster.save_model(run.model, path)
        saved = run.state()
    finally:
        run.close()
    dist.barrier()
    file_state = torch.load(path, map_location="cpu", weights_only=True)
    # A standard HF state dict: plain transformers loads it strictly and reproduces the loss.
    config = build_hf_config(model_cfg)
    plain = type(build_model(model_cfg))(config)
    plain.load_state_dict(file_state, strict=True)
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0, msg=name)
    for new_widths, tp in ((other_widths, 2), (None, 1)):
        loaded = _Run(model_cfg, new_widths, tp=tp)
        try:
            loaded.booster.load_model(loaded.model, path)
            state = loaded.state()
            for name, tensor in saved.items():
                torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)
            loss = float(loaded.criterion(loaded.model(**_batch(2)), _batch(2)))
        finally:
            loaded.close()
        expected = float(plain(**_batch(2)).loss)
        # Same weights, other split (or none): the forward chain's bound.
        assert abs(loss - expected) <= FORWARD_RTOL * abs(expected), (tp, loss, expected)


def _train(model_cfg, widths, steps, resizes=None):
    """Adam steps; ``resizes[step]`` = (widths, when): "before" the step or "inside" it."""
    run = _Run(model_cfg, widths, optimizer="adam")
    losses = []
    try:
        for step in range(steps):
            batch = _batch(10 + step)
            new_widths, when = (resizes or {}).get(step, (None, None))
            if when == "before":
                run.plugin.resize(run.model, run.optimizer, new_widths)
            if when == "inside":  # between backward and step: the gradients move too
                losses.append(run.backward(batch))
                run.plugin.resize(run.model, run.optimizer, new_widths)
                run.optimizer.step()
                run.optimizer.zero_grad()
            else:
                losses.append(run.step(batch))
        return losses, gather_full(run.model, run.optimizer)
    finally:
        run.close()


def _check_resize(model_cfg, widths, other_widths, steps=6):
    """Resizing (before step 2, inside step 4) continues exactly as stopping there, gathering
    the full state and restarting at the new widths from it (like with like: same kernels,
    same shard shapes; tests/restart.py says why a never-resized run is no reference)."""
    resizes = {2: (other_widths, "before"), 4: (widths, "inside")}
    losses, state = _train(model_cfg, widths, steps, resizes)
    expected_losses: list[float] = []
    expected_state: dict[str, torch.Tensor] = {}
    for phase_widths, first, last in ((widths, 0, 2), (other_widths, 2, 4), (widths, 4, steps)):
        run = _Run(model_cfg, phase_widths, optimizer="adam")
        try:
            if expected_state:
                load_full(run.model, run.optimizer, expected_state, ADAM_STATE)
                if first == 4:  # step 4's backward ran at the other widths
                    run.optimizer.step()
                    run.optimizer.zero_grad()
            for step in range(first + (first == 4), last):
                expected_losses.append(run.step(_batch(10 + step)))
            if last == 4:
                expected_losses.append(run.backward(_batch(10 + last)))
            expected_state = gather_full(run.model, run.optimizer)
        finally:
            run.close()
    assert losses == expected_losses, (losses, expected_losses)
    assert state.keys() == expected_state.keys()
    for name, tensor in expected_state.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)


def _check_training(model_cfg, widths, steps=20):
    """20 Adam steps learn, and every step's loss equals the dense model's at the same weights
    (the gathered ones): one forward chain apart, however far the trajectory has gone."""
    run = _Run(model_cfg, widths, optimizer="adam")
    reference = build_model(model_cfg)
    try:
        for step in range(steps):
            batch = _batch(100 + step, learnable=True)
            reference.load_state_dict(run.state())
            with torch.no_grad():
                ref = float(reference(**batch).loss)
            loss = run.step(batch)
            assert abs(loss - ref) <= FORWARD_RTOL * abs(ref), (step, loss, ref)
    finally:
        run.close()
    assert loss < 0.95 * _first_loss(model_cfg), "uneven-TP training did not learn"


def _first_loss(model_cfg) -> float:
    return float(build_model(model_cfg)(**_batch(100, learnable=True)).loss)


def _check_pipeline_parity(model_cfg, widths):
    """TP=2 x PP=2: Colossal-AI's pipeline forwards around the resizable layers."""
    batch = _batch()
    ref_loss, ref_grads = _reference_grads(model_cfg, batch)
    run = _Run(model_cfg, widths, pp=2)
    try:
        loss = run.pipeline_step(batch)
        after = run.state()
    finally:
        run.close()
    if loss is not None:
        assert abs(loss - ref_loss) <= FORWARD_RTOL * abs(ref_loss), f"loss {loss} vs {ref_loss}"
    assert after, "this stage holds no parameters"
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, tensor in after.items():
        grad = (run.initial[name] - tensor) / LR
        atol = _grad_atol(scale, run.initial[name], tensor)
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=atol, msg=name)


def _check_bad_widths():
    """Widths that do not fit the model (or the alignment) fail at boost, on every rank."""
    cases = [
        ({"ffn": (88, 8)}, {"ffn": 16}, "multiple of 16"),
        ({"heads": (5, -1)}, None, "at least 0"),
        ({"heads": (0, 0)}, None, "sums to 0"),
        ({"vocab": (200, 50)}, None, "sums to 250"),
    ]
    for widths, align, message in cases:
        policy = resizable_policy(build_model(GPT2), widths, align=align)
        plugin = HeteroParallelPlugin(HeteroConfig(parallel=ParallelConfig(tp=2)), policy=policy)
        try:
            with pytest.raises(ValueError, match=message):
                Booster(plugin=plugin).boost(build_model(GPT2))
        finally:
            plugin.close()


def _pipelines(rank, world_size, device):
    prepare_device(device)
    _check_pipeline_parity(GPT2, GPT2_WIDTHS)
    _check_pipeline_parity(LLAMA, LLAMA_WIDTHS)
    _check_pipeline_parity(GPT2, GPT2_NO_HEADS)  # Colossal-AI's stage forwards, no heads
    _check_pipeline_parity(LLAMA, LLAMA_NO_HEADS)


def _models(rank, world_size, device, folder):
    prepare_device(device)
    _check_parity(GPT2, GPT2_WIDTHS)
    _check_parity(LLAMA, LLAMA_WIDTHS)
    _check_parity(GPT2, GPT2_NO_HEADS)
    _check_parity(LLAMA, LLAMA_NO_HEADS)
    _check_bad_widths()
    _check_parity(BERT, {"heads": (1, 3), "ffn": (60, 4), "vocab": (300, 20)}, _mlm_batch())
    _check_parity(VIT, {"heads": (3, 1), "ffn": (0, 64)}, _image_batch())
    _check_checkpoint(GPT2, GPT2_WIDTHS, {"heads": (0, 4), "vocab": (0, 256)}, folder, rank)
    _check_checkpoint(LLAMA, LLAMA_NO_HEADS, {}, folder, rank)
    # into zero heads before step 2, out of them inside step 4
    _check_resize(GPT2, GPT2_WIDTHS, {"heads": (4, 0), "ffn": (8, 88), "vocab": (56, 200)})
    _check_resize(LLAMA, LLAMA_WIDTHS, {"heads": (0, 6), "ffn": (40, 24), "vocab": (256, 0)})
    _check_training(GPT2, GPT2_WIDTHS)
    _check_training(LLAMA, LLAMA_WIDTHS)


@pytest.mark.numerics
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_uneven_models_parity_checkpoint_resize_and_training(tmp_path):
    """One spawn (each costs seconds of imports): the checks name what failed."""
    run_distributed(_models, world_size=2, folder=str(tmp_path))


@pytest.mark.numerics
@pytest.mark.dist
@pytest.mark.slow  # four ranks on two cores
@pytest.mark.timeout(600)
def test_uneven_tp_with_pipeline_matches_reference():
    run_distributed(_pipelines, world_size=4)
