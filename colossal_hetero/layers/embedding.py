"""Vocabulary-parallel embedding and LM head with per-rank vocabulary widths.

Shape letters (R ranks in ``group``, this rank r):
    V vocabulary, split by widths v_0..v_{R-1} (any may be 0); rank r owns ids
    [o_r, o_r + v_r) with o_r = v_0 + ... + v_{r-1}. D embedding (hidden) size.
    weight [V, D] in both layers, so an LM head tied to the embedding shares one shard.

Embedding: ids [*] replicated -> out [*, D] = all-reduce over ``group`` of the local lookup
           (ids outside the own range give zeros); backward: identity (each rank's rows get
           the gradient of the tokens it owns).
LM head:   hidden [*, D] replicated -> logits_local [*, v_r] (gather_output: logits [*, V]);
           backward: d hidden all-reduced over ``group``. Pair it with
           layers.loss.vocab_parallel_cross_entropy, which needs no gathered logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from colossal_hetero.comm import all_reduce, offsets
from colossal_hetero.layers.linear import ResizableLinearCol, ResizableParallelModule, single_group
from colossal_hetero.layers.sharding import ShardLayout, shard_parameter


class ResizableVocabEmbedding(ResizableParallelModule):
    """Embedding whose rows (the vocabulary) are split by ``widths`` over ``group``.

    Replaces colossalai's VocabParallelEmbedding1D, without its padding of the vocabulary:
    the shards are uneven instead.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        widths: Sequence[int],
        *,
        group: ProcessGroup,
        padding_idx: int | None = None,
        weight: nn.Parameter | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(widths, group=group)
        if sum(self.widths) != num_embeddings:
            raise ValueError(f"widths {list(self.widths)} do not cover {num_embeddings} embeddings")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        if weight is None:
            weight = nn.Parameter(
                torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
            )
            nn.init.normal_(weight)
        self.weight = shard_parameter(weight, self.param_layouts(self.widths)["weight"])

    def param_layouts(self, widths: Sequence[int]) -> dict[str, ShardLayout]:
        return {"weight": ShardLayout(0, tuple(widths), self.group)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start, width = offsets(self.widths)[self.rank], self.local_width
        if width == 0:
            # No rows here: contribute zeros, kept in the graph so the (empty) grad exists.
            out = self.weight.new_zeros((*ids.shape, self.embedding_dim)) + self.weight.sum()
        else:
            outside = (ids < start) | (ids >= start + width)
            local_ids = (ids - start).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight, self._local_padding_idx(start, width))
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return all_reduce(out, group=self.group)

    def _local_padding_idx(self, start: int, width: int) -> int | None:
        if self.padding_idx is None or not start <= self.padding_idx < start + width:
            return None
        return self.padding_idx - start

    @staticmethod
    def from_native_module(
        module: nn.Module, process_group: Any, *, widths: Sequence[int], **kwargs: Any
    ) -> ResizableVocabEmbedding:
        """Shard ``module`` (an nn.Embedding) in place by vocabulary ``widths``."""
        from colossalai.lazy import LazyInitContext

        LazyInitContext.materialize(module)
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise ValueError("max_norm, sparse and scale_grad_by_freq embeddings are not supported")
        return ResizableVocabEmbedding(
            module.num_embeddings,
            module.embedding_dim,
            widths,
            group=single_group(process_group),
            padding_idx=module.padding_idx,
            weight=module.weight,
            **kwargs,
        )

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {super().extra_repr()}"


class ResizableLMHead(ResizableLinearCol):
    """Vocabulary-parallel LM head: a column-parallel linear over ``widths`` of the vocabulary.

    Its weight [V, D] may be the (already sharded) embedding weight: tied weights share one
    shard, which needs equal widths. Replaces colossalai's VocabParallelLMHead1D, without
    padding the vocabulary.
    """

    @staticmethod
    def from_native_module(
        module: nn.Module, process_group: Any, *, widths: Sequence[int], **kwargs: Any
    ) -> ResizableLMHead:
        """Shard ``module`` (an nn.Linear [V, D]) in place; kwargs: gather_output."""
        return ResizableLMHead._from_native(module, process_group, widths, **kwargs)
