"""The shardformer policy for a model already converted to 2D: leave it as it is.

Colossal-AI's HybridParallelPlugin shards every model through a shardformer policy; a 2D model
is converted by tp2d/convert.py before that (its layers are not shardformer's 1D ones), so the
engine gets this policy, which replaces no module and shares no parameter across stages.
"""

from __future__ import annotations

from colossalai.shardformer.policies.base_policy import Policy
from torch import nn


class Converted2DPolicy(Policy):
    """A no-op policy: the model keeps its 2D modules (pipeline parallelism unsupported)."""

    def config_sanity_check(self) -> None:
        return None

    def preprocess(self) -> nn.Module:
        return self.model

    def module_policy(self) -> dict:
        return {}

    def postprocess(self) -> nn.Module:
        return self.model

    def get_held_layers(self) -> list[nn.Module]:
        return list(self.model.children())

    def get_shared_params(self) -> list:
        return []
