"""Resizable tensor-parallel layers: shardformer ParallelModules split by per-rank widths.

Each layer shards its parameters by ``widths`` over a TP group, carries Colossal-AI's
customized-distributed-tensor hooks (so checkpoints hold full Hugging Face tensors), and can be
given new widths between steps (``resize``).
"""

from colossal_hetero.layers.embedding import ResizableLMHead, ResizableVocabEmbedding
from colossal_hetero.layers.linear import (
    ResizableConv1DCol,
    ResizableConv1DRow,
    ResizableLinearCol,
    ResizableLinearRow,
    ResizableParallelModule,
)
from colossal_hetero.layers.loss import causal_lm_loss, vocab_parallel_cross_entropy
from colossal_hetero.layers.resize import resize_layer, resize_layers, resize_parameter
from colossal_hetero.layers.sharding import ShardLayout, layout_of, merge_shards, shard_of

__all__ = [
    "ResizableConv1DCol",
    "ResizableConv1DRow",
    "ResizableLMHead",
    "ResizableLinearCol",
    "ResizableLinearRow",
    "ResizableParallelModule",
    "ResizableVocabEmbedding",
    "ShardLayout",
    "causal_lm_loss",
    "layout_of",
    "merge_shards",
    "resize_layer",
    "resize_layers",
    "resize_parameter",
    "shard_of",
    "vocab_parallel_cross_entropy",
]
