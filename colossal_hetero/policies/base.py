"""The mixin that turns a stock Colossal-AI shardformer policy into an uneven (resizable) one.

A resizable policy is ``class P(ResizablePolicy, StockPolicy)``. Its ``module_policy`` asks
the stock policy for its description (so pipeline forwards, held layers, shared parameters,
norm and dropout replacements stay Colossal-AI's), then rewrites the tensor-parallel parts:

- every TP layer named in ``layer_specs`` becomes its resizable counterpart, with this
  rank's widths in features;
- the per-rank attribute replacements (heads, split sizes, ...) are computed from this
  rank's widths instead of dividing evenly;
- model-specific forwards (the LM loss) may be replaced by ``replace_forwards``.

The stock policies assert that heads divide evenly; their description is built under a view
of the shard config with a TP size of 1, which skips those checks and whose even-split
values are all overwritten here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch.distributed as dist
from colossalai.shardformer._utils import getattr_, setattr_
from colossalai.shardformer.policies.base_policy import ModulePolicyDescription
from torch import nn

from colossal_hetero.layers import ResizableParallelModule, resize_layers
from colossal_hetero.policies.widths import resolve_widths

# Keyword arguments of the stock replacements that keep their meaning for resizable layers.
_KEPT_KWARGS = ("gather_output", "skip_bias_add", "parallel_input")


@dataclass(frozen=True)
class LayerSpec:
    """Replace ``owner``'s submodule ``suffix`` by ``layer``, sized by widths ``key``."""

    owner: type
    suffix: str
    layer: type[ResizableParallelModule]
    key: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def _stock_view(shard_config: Any) -> Iterator[None]:
    """The shard config as a TP size of 1 (no even-split assertions), restored afterwards."""
    saved = shard_config._tensor_parallel_size
    shard_config._tensor_parallel_size = 1
    try:
        yield
    finally:
        shard_config._tensor_parallel_size = saved


class ResizablePolicy:
    """Mixin for a stock shardformer policy: per-rank widths instead of an even split.

    Args:
        widths: per key (see ``width_totals``: ``heads``, ``ffn``, ``vocab``), one count per
            TP rank; missing keys are split evenly. Checked against the model when sharding.
        align: per key, a granularity every count must be a multiple of (e.g. 64 for ``ffn``
            and ``vocab`` on GPUs); combined with the model's own (query groups for heads).
    """

    shard_config: Any
    model: nn.Module

    def __init__(
        self,
        widths: Mapping[str, Sequence[int]] | None = None,
        *,
        align: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__()
        self.requested_widths = {key: tuple(counts) for key, counts in (widths or {}).items()}
        self.align = dict(align or {})
        self.widths: dict[str, tuple[int, ...]] = {}

    # -- what a model policy defines ----------------------------------------------------
    def width_totals(self) -> dict[str, int]:
        """Per key, the model's total count (e.g. its number of attention heads)."""
        raise NotImplementedError

    def width_units(self) -> dict[str, int]:
        """Per key, the granularity of the counts (default 1)."""
        return {}

    def min_widths(self) -> dict[str, int]:
        """Per key, the least a rank may hold. transformers' attention needs >= 1 head."""
        return {"heads": 1}

    def head_dim(self) -> int:
        """Features per attention head."""
        config = self.model.config
        return config.hidden_size // config.num_attention_heads

    def feature_widths(self, key: str, widths: Mapping[str, Sequence[int]]) -> tuple[int, ...]:
        """Per-rank widths in features of the layers sized by ``key``."""
        unit = self.head_dim() if key == "heads" else 1
        return tuple(unit * count for count in widths[key])

    def layer_specs(self) -> list[LayerSpec]:
        """The TP layers to replace."""
        raise NotImplementedError

    def attribute_values(self, local: Mapping[str, int]) -> dict[type, dict[str, Any]]:
        """Per owner class, the attributes to set from this rank's counts ``local``."""
        return {}

    def replace_forwards(self, policy: dict) -> None:
        """Hook: replace forwards in ``policy`` (e.g. for a loss over uneven vocab shards)."""

    @staticmethod
    def wrap_forward(policy: dict, owner: type, wrapper: Any) -> None:
        """Replace ``owner``'s forward by ``wrapper(self, ..., stock=previous forward)``, where
        the previous forward is what the stock policy installed, else the class's own."""
        description = policy.setdefault(owner, ModulePolicyDescription())
        methods = dict(description.method_replacement or {})
        stock = methods.get("forward", getattr(owner, "forward"))  # noqa: B009
        methods["forward"] = partial(wrapper, stock=stock)
        description.method_replacement = methods

    # -- the rewrite --------------------------------------------------------------------
    @property
    def tp_group(self) -> Any:
        """The tensor-parallel process group."""
        return self.shard_config.tensor_parallel_process_group

    def resolve(self, widths: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
        """``widths`` checked against the model, missing keys split evenly."""
        units = dict(self.width_units())
        for key, multiple in self.align.items():
            units[key] = math.lcm(units.get(key, 1), multiple)
        return resolve_widths(
            widths,
            self.width_totals(),
            dist.get_world_size(self.tp_group),
            units=units,
            min_width=self.min_widths(),
        )

    def module_policy(self) -> dict:
        """The stock description with resizable TP layers and per-rank attributes."""
        if not self.shard_config.enable_tensor_parallelism:
            return super().module_policy()  # type: ignore[misc]
        if self.shard_config.enable_sequence_parallelism or self.shard_config.fp8_communication:
            raise ValueError("resizable TP supports neither sequence parallelism nor fp8 comm")
        self.widths = self.resolve(self.requested_widths)
        with _stock_view(self.shard_config):
            policy = super().module_policy()  # type: ignore[misc]
        self._use_resizable_layers(policy)
        for owner, values in self.attribute_values(self._local_counts()).items():
            policy.setdefault(owner, ModulePolicyDescription()).attribute_replacement = values
        self.replace_forwards(policy)
        return policy

    def _local_counts(self) -> dict[str, int]:
        rank = dist.get_rank(self.tp_group)
        return {key: counts[rank] for key, counts in self.widths.items()}

    def _use_resizable_layers(self, policy: dict) -> None:
        specs = {(spec.owner, spec.suffix): spec for spec in self.layer_specs()}
        for owner, description in policy.items():
            for item in description.sub_module_replacement or []:
                spec = specs.get((owner, item.suffix))
                if spec is None:
                    continue
                kept = {k: v for k, v in (item.kwargs or {}).items() if k in _KEPT_KWARGS}
                item.target_module = spec.layer
                widths = self.feature_widths(spec.key, self.widths)
                item.kwargs = {**kept, **spec.kwargs, "widths": widths}

    # -- resizing between steps ---------------------------------------------------------
    def resize(self, widths: Mapping[str, Sequence[int]], *, optimizer: Any = None) -> None:
        """Move the sharded model to new ``widths``; lossless (see layers.resize).

        Call on every TP rank between steps, with the booster's optimizer (or the torch one)
        so that its state (and mixed precision's fp32 master weights) moves too. Keys left out
        are split evenly. This moves the layers only: a boosted model wrapped in torch DDP
        needs ``HeteroParallelPlugin.resize``, which also rebuilds the DDP.
        """
        new = self.resolve(widths)
        changes = []
        for module in self.model.modules():
            for spec in self.layer_specs():
                layer = getattr_(module, spec.suffix, ignore=True)
                if type(module) is spec.owner and isinstance(layer, ResizableParallelModule):
                    changes.append((layer, self.feature_widths(spec.key, new)))
        resize_layers(changes, optimizer=optimizer)
        self.widths = new
        values = self.attribute_values(self._local_counts())
        for module in self.model.modules():
            for attr, value in values.get(type(module), {}).items():
                setattr_(module, attr, value, ignore=True)
