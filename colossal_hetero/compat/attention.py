"""Keep GPT-2 causal under Colossal-AI's shardformer forwards (all devices).

With tensor parallelism (``parallel_output``) or pipeline parallelism, Colossal-AI 0.5 replaces
GPT-2's forward with its own, which passes the attention layers a *padding-only* additive mask
of shape [B, 1, 1, S]. transformers 4.51 builds GPT-2 with SDPA attention by default, and its
SDPA path turns causality off whenever a mask is given: every token then attends to the future
(the loss falls far faster than it should, and parity with the unsharded model is lost). The
eager path applies GPT-2's causal mask itself and adds the padding mask on top, which is what
the shardformer forward expects. So GPT-2 models are switched to eager attention before
sharding. Found by tests/distributed/test_parity.py.
"""

from __future__ import annotations

from torch import nn


def keep_gpt2_causal(model: nn.Module) -> bool:
    """Switch a transformers GPT-2 model to eager attention; returns whether it changed.

    The config object is shared by every attention layer, which reads it at forward time.
    """
    from transformers.models.gpt2.modeling_gpt2 import GPT2Model, GPT2PreTrainedModel

    if not isinstance(model, GPT2PreTrainedModel):
        return False
    config = model.config
    if config._attn_implementation == "eager":
        return False
    config._attn_implementation = "eager"
    for module in model.modules():
        if isinstance(module, GPT2Model):
            module._attn_implementation = "eager"
    return True
