"""Zero-head TP ranks (policies/zero_heads.py) in bf16 and with a key/value cache.

On 2 gloo ranks (TP=2), one rank holding no attention heads:

- bf16 (``parallel.precision`` bf16, fp32 master weights): one SGD step's loss and every updated
  weight equal, bitwise, those of the mirrored layout (the heads on the other rank, the MLP and
  vocabulary split unchanged). Why not the dense model: tests/tolerances.py's bound for two
  summation orders of this model in bf16, chain_atol(transformer_depth(2), 320, bf16, 1), is
  ~100x the result's magnitude, so a dense comparison could not fail. The mirror can: with all
  heads on one rank, the attention runs on that rank with the same kernels and shapes in both
  layouts, and the other rank adds exact zeros to the output projection's all-reduce and to the
  QKV layers' input-gradient all-reduce (x + 0 = x in any order), so nothing may differ by
  even one rounding. A zero-head forward that added anything, or lost a gradient, would.
- generation (fp32): a prompt with ``use_cache=True``, then decoding steps that feed the cache
  back one token at a time. Each step's logits equal the dense model's within the forward
  chain's bound (tests/tolerances.py, as test_resizable_models.py), the zero-head rank's cache
  entries are empty ([batch, 0 heads, positions so far, head_dim]: the positions advance with
  the dense cache's), and the other rank's entries equal the dense model's (all heads).
"""

from __future__ import annotations

import pytest
import torch

from colossal_hetero.models import build_model
from colossal_hetero.plugin import prepare_device
from tests.dist_utils import run_distributed
from tests.distributed.test_resizable_models import FORWARD_RTOL, _batch, _Run
from tests.tiny_models import GPT2, LLAMA

# The heads on one rank, everything else split unevenly (and the same in the mirror).
GPT2_SPLIT = {"ffn": (80, 16), "vocab": (200, 56)}
LLAMA_SPLIT = {"ffn": (16, 48), "vocab": (31, 225)}
DECODE_STEPS = 4


def _bf16_step(model_cfg, widths) -> tuple[float, dict[str, torch.Tensor]]:
    run = _Run(model_cfg, widths, precision="bf16")
    try:
        loss = run.step(_batch())
        return loss, run.state()
    finally:
        run.close()


def _check_bf16_mirror(model_cfg, split, heads) -> None:
    """Heads ``(0, n)`` against ``(n, 0)``: bitwise equal loss and weights after one step."""
    loss, state = _bf16_step(model_cfg, {"heads": (0, heads), **split})
    mirror_loss, mirror_state = _bf16_step(model_cfg, {"heads": (heads, 0), **split})
    initial = build_model(model_cfg).state_dict()
    assert loss == mirror_loss, (model_cfg.arch, loss, mirror_loss)
    assert state.keys() == mirror_state.keys()
    moved = 0
    for name, tensor in mirror_state.items():
        assert tensor.dtype == torch.bfloat16, name  # the working weights ran in bf16
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)
        moved += int(not torch.equal(tensor.float(), initial[name].to(torch.bfloat16).float()))
    assert moved > len(mirror_state) // 2, "the step moved too few weights to compare"


def _cache_entries(past, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s key and value cache: a legacy tuple (GPT-2) or a transformers Cache."""
    if isinstance(past, (tuple, list)):
        return past[layer][0], past[layer][1]
    return past.key_cache[layer], past.value_cache[layer]


def _check_cache(past, dense_past, layers: int, has_heads: bool, atol: float) -> None:
    for layer in range(layers):
        pairs = zip(_cache_entries(past, layer), _cache_entries(dense_past, layer), strict=True)
        for entry, dense in pairs:
            if has_heads:
                torch.testing.assert_close(entry, dense, rtol=0, atol=atol)
            else:
                batch, _, positions, head_dim = dense.shape
                assert entry.shape == (batch, 0, positions, head_dim), (entry.shape, dense.shape)


def _cached_logits(run, ids, past, rank: int):
    """This rank's vocabulary shard of the logits, and the new cache, through the model body's
    transformers forward (the class's: Colossal-AI's Llama body forward, installed at pp 1,
    turns the cache off) and the vocabulary-parallel LM head."""
    model = run.model.unwrap()
    body_forward = type(model.base_model).forward
    body = body_forward(model.base_model, input_ids=ids, past_key_values=past, use_cache=True)
    logits = model.lm_head(body.last_hidden_state)
    first = sum(model.lm_head.widths[:rank])
    return logits, body.past_key_values, slice(first, first + model.lm_head.widths[rank])


def _check_decoding(model_cfg, widths, rank: int) -> None:
    """A cached prompt then DECODE_STEPS one-token steps (greedy on the dense logits)."""
    dense = build_model(model_cfg).eval()
    run = _Run(model_cfg, widths)
    has_heads = widths["heads"][rank] > 0
    layers = dense.config.num_hidden_layers
    ids = _batch(batch_size=2, seq_len=6)["input_ids"]
    past = dense_past = None
    try:
        with torch.no_grad():
            for step in range(DECODE_STEPS + 1):
                logits, past, vocab = _cached_logits(run, ids, past, rank)
                ref = dense(input_ids=ids, past_key_values=dense_past, use_cache=True)
                dense_past = ref.past_key_values
                atol = FORWARD_RTOL * float(ref.logits.abs().max())
                expected = ref.logits[..., vocab]
                torch.testing.assert_close(logits, expected, rtol=0, atol=atol, msg=str(step))
                _check_cache(past, dense_past, layers, has_heads, atol)
                ids = ref.logits[:, -1:].argmax(dim=-1)
    finally:
        run.close()


def _zero_heads(rank, world_size, device) -> None:
    prepare_device(device)
    _check_decoding(GPT2, {"heads": (0, 4), **GPT2_SPLIT}, rank)
    _check_decoding(LLAMA, {"heads": (6, 0), **LLAMA_SPLIT}, rank)
    _check_bf16_mirror(GPT2, GPT2_SPLIT, 4)
    _check_bf16_mirror(LLAMA, LLAMA_SPLIT, 6)


@pytest.mark.numerics
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_zero_head_rank_in_bf16_and_with_a_kv_cache():
    """One spawn (each costs seconds of imports): the checks name what failed."""
    run_distributed(_zero_heads, world_size=2, force_cpu=True)
