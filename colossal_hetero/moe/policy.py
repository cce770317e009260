"""Shardformer policy installing :class:`.block.HeteroEPMixtralSparseMoeBlock` (ours) where
Colossal-AI's Mixtral policy installs its ``EPMixtralSparseMoeBlock``.

Everything else (attention, embeddings, pipeline forwards) stays Colossal-AI's
``MixtralForCausalLMPolicy``; only the MoE block's replacement description is retargeted and
given the shared :class:`.comm.MoeComm` and the expert placement.
"""

from __future__ import annotations

from typing import Any

from colossalai.shardformer.policies.mixtral import MixtralForCausalLMPolicy

from colossal_hetero.moe.block import HeteroEPMixtralSparseMoeBlock
from colossal_hetero.moe.comm import MoeComm
from colossal_hetero.moe.placement import Placement


class HeteroMixtralForCausalLMPolicy(MixtralForCausalLMPolicy):
    """``MixtralForCausalLMPolicy`` with our expert-parallel block (needs an ep group)."""

    def __init__(self, comm: MoeComm, placement: Placement, packing: bool = False) -> None:
        super().__init__()
        self.comm, self.placement, self.packing = comm, placement, packing

    def module_policy(self) -> Any:
        from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

        if not self.shard_config.ep_group:
            raise ValueError("HeteroMixtralForCausalLMPolicy needs an expert-parallel group")
        policy = super().module_policy()
        replaced = 0
        for description in policy[MixtralDecoderLayer].sub_module_replacement:
            if description.suffix == "block_sparse_moe":
                description.target_module = HeteroEPMixtralSparseMoeBlock
                description.kwargs = {
                    **description.kwargs,
                    "comm": self.comm,
                    "placement": self.placement,
                    "packing": self.packing,
                }
                replaced += 1
        if replaced != 1:  # Colossal-AI's policy changed shape: fail loudly, not silently stock
            raise RuntimeError(f"expected one block_sparse_moe replacement, found {replaced}")
        return policy
