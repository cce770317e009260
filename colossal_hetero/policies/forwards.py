"""Causal-LM forwards whose loss is right under uneven vocabulary shards.

Colossal-AI's LM forwards compute the loss with ``dist_cross_entropy``, which derives every
rank's vocabulary range from an even split. These forwards keep Colossal-AI's model bodies
(pipeline stages included) and compute the loss from the LM head's own widths with
``layers.loss.causal_lm_loss``: sum over tokens / number of non-ignored tokens, as
transformers does. The head's widths are read at call time, so resizing needs no rebinding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from colossal_hetero.layers import ResizableLMHead, causal_lm_loss


def head_loss(head: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of ``logits`` from the resizable LM ``head`` against ``labels``."""
    if not isinstance(head, ResizableLMHead):
        raise TypeError(f"expected a ResizableLMHead, got {type(head).__name__}")
    return causal_lm_loss(
        logits, labels, widths=head.widths, group=head.group, gathered=head.gather_output
    )


def refuse_cache(past_key_values: Any) -> None:
    """ValueError for a non-empty key/value cache: Colossal-AI's sharded GPT-2 body drops it
    (with a logged warning), so cached decoding would attend to the new tokens alone."""
    if past_key_values:
        raise ValueError(
            "past_key_values: the boosted GPT-2 does not decode from a key/value cache "
            "(Colossal-AI's sharded forward drops it); pass use_cache=False to generate"
        )


def lm_forward_with_uneven_loss(
    self: nn.Module,
    *args: Any,
    stock: Callable[..., Any],
    labels: torch.Tensor | None = None,
    return_dict: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``stock(self, ...)`` without labels, then add the loss from ``self.lm_head``.

    Non-final pipeline stages return the stock dict of hidden states unchanged. Needs a stock
    forward that tolerates ``labels=None`` (Colossal-AI's Llama forwards do).
    """
    outputs = stock(self, *args, labels=None, return_dict=True, **kwargs)
    if labels is None or "logits" not in outputs:
        return outputs
    loss = head_loss(self.lm_head, outputs["logits"], labels)
    outputs = type(outputs)(loss=loss, **{k: v for k, v in outputs.items() if k != "loss"})
    return outputs.to_tuple() if return_dict is False else outputs


def gpt2_lm_forward(
    self: nn.Module,
    input_ids: torch.Tensor | None = None,
    past_key_values: Any = None,
    attention_mask: torch.Tensor | None = None,
    token_type_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    head_mask: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    encoder_hidden_states: torch.Tensor | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    use_cache: bool | None = None,
    output_attentions: bool | None = None,
    output_hidden_states: bool | None = None,
    return_dict: bool | None = None,
    stage_manager: Any = None,
    hidden_states: torch.Tensor | None = None,
    stage_index: list[int] | None = None,
    shard_config: Any = None,
) -> Any:
    """GPT2LMHeadModel forward: Colossal-AI's GPT-2 body, the LM head, the uneven-vocab loss.

    Colossal-AI's own LM forward cannot run without labels (it leaves ``loss`` unbound), so
    this mirrors it around ``GPT2PipelineForwards.gpt2_model_forward``.
    """
    from colossalai.shardformer.modeling.gpt2 import GPT2PipelineForwards

    refuse_cache(past_key_values)
    outputs = GPT2PipelineForwards.gpt2_model_forward(
        self.transformer,
        input_ids,
        past_key_values=past_key_values,
        attention_mask=attention_mask,
        token_type_ids=token_type_ids,
        position_ids=position_ids,
        head_mask=head_mask,
        inputs_embeds=inputs_embeds,
        encoder_hidden_states=encoder_hidden_states,
        encoder_attention_mask=encoder_attention_mask,
        use_cache=use_cache,
        output_attentions=output_attentions,
        output_hidden_states=output_hidden_states,
        return_dict=True,
        stage_manager=stage_manager,
        hidden_states=hidden_states,
        stage_index=stage_index,
        shard_config=shard_config,
        force_sp_gather=False,
    )
    if stage_manager is not None and not stage_manager.is_last_stage():
        return {"hidden_states": outputs["hidden_states"]}
    return _lm_output(self.lm_head, outputs, labels, return_dict)


def _lm_output(lm_head: nn.Module, outputs: Any, labels: Any, return_dict: bool | None) -> Any:
    """The LM head's logits and loss wrapped as transformers' causal-LM output."""
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    logits = lm_head(outputs[0])
    result = CausalLMOutputWithCrossAttentions(
        loss=None if labels is None else head_loss(lm_head, logits, labels),
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        cross_attentions=outputs.cross_attentions,
    )
    return result.to_tuple() if return_dict is False else result
