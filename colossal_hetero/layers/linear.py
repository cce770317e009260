"""Column- and row-parallel linear layers with per-rank widths (nn.Linear and GPT-2 Conv1D).

Shape letters (R ranks in ``group``, this rank r):
    K in_features, N out_features; widths w_0..w_{R-1} sum to N (column) or K (row).
    P fused parts (3 for GPT-2's c_attn: [Q | K | V], each split by the same widths).
    nn.Linear weight [N, K]; HF Conv1D weight [K, N] (``transposed`` layers).

Column:  x [*, K] replicated -> y_local [*, P * w_r]  (gather_output: y [*, P * sum(w)])
         forward: no communication (gather_output: all-gather over ``group``)
         backward: dx = all-reduce over ``group`` of dy_local @ W_local, started before dW
         is computed and overlapping it (layers/overlap.py; a balancing op keeps its own path)
Row:     x_local [*, w_r] -> y [*, N] = all-reduce over ``group`` of x_local @ W_local^T, + b
         backward: identity for dy; dx_local = dy @ W_local (parallel_input=False: the input
         is split here and its gradient all-gathered over ``group``)

A rank may hold zero width: its output is empty (column) or zeros (row); it still takes part in
every collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from colossalai.shardformer.layer import ParallelModule
from torch import nn
from torch.distributed import ProcessGroup

from colossal_hetero.comm import (
    all_gather_uneven,
    all_reduce,
    check_widths,
    copy_to_group,
    split_uneven,
)
from colossal_hetero.layers.overlap import column_linear, row_linear
from colossal_hetero.layers.sharding import ShardLayout, full_shape, merge_shards, shard_parameter


def single_group(process_group: ProcessGroup | Sequence[ProcessGroup]) -> ProcessGroup:
    """The one TP group shardformer passes (it may come as a one-element list)."""
    if isinstance(process_group, (list, tuple)):
        if len(process_group) != 1:
            raise ValueError(f"expected one process group, got {len(process_group)}")
        process_group = process_group[0]
    if not isinstance(process_group, ProcessGroup):
        raise ValueError("process_group is required (None would silently mean the world group)")
    return process_group


class LocalOp(Protocol):
    """A replacement for one rank's local ``F.linear`` (balance/ops: ZERO-resizing, migration).

    Called as ``op(x, weight, bias, layer)`` with ``weight`` as [N_local, K_local] (a view for
    Conv1D); must return the same shape and dtype as ``F.linear(x, weight, bias)``.
    """

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer: ResizableParallelModule,
    ) -> torch.Tensor: ...


class ResizableParallelModule(ParallelModule):
    """Base of the resizable layers: per-rank ``widths`` over a TP ``group``.

    Subclasses say how each sharded parameter is laid out for given widths
    (``param_layouts``); resize.py uses that to move weights, gradients and optimizer state
    when the widths change.
    """

    def __init__(self, widths: Sequence[int], *, group: ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.widths = check_widths(widths, group)
        self.rank = dist.get_rank(group)
        self.local_op: LocalOp | None = None  # set by balance/ops; identical on every rank

    def _local_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x @ weight^T (+ bias) on this rank, or ``local_op`` while training with autograd on.

        Eval and no-grad inference always take the plain product (no op ever runs there).
        """
        op = self.local_op
        if op is None or not self.op_active():
            return F.linear(x, weight, bias)
        return op(x, weight, bias, self)

    def op_active(self) -> bool:
        """Whether ``local_op`` runs now: attached, training, autograd on."""
        return self.local_op is not None and self.training and torch.is_grad_enabled()

    @property
    def local_width(self) -> int:
        """This rank's width."""
        return self.widths[self.rank]

    def param_layouts(self, widths: Sequence[int]) -> dict[str, ShardLayout]:
        """Name -> layout of every sharded parameter for ``widths`` (replicated ones omitted)."""
        raise NotImplementedError

    def set_widths(self, widths: Sequence[int]) -> None:
        """Adopt ``widths`` once the parameters have been re-sharded to them."""
        self.widths = check_widths(widths, self.group)

    def extra_repr(self) -> str:
        return f"widths={list(self.widths)}, rank={self.rank}"


def _new_weight(shape: Sequence[int], device: Any, dtype: Any) -> nn.Parameter:
    weight = nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    return weight


class _ColumnParallel(ResizableParallelModule):
    transposed = False  # Conv1D keeps its weight as [K, N]

    def __init__(
        self,
        in_features: int,
        widths: Sequence[int],
        *,
        group: ProcessGroup,
        num_parts: int = 1,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        weight: nn.Parameter | None = None,
        bias_: nn.Parameter | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(widths, group=group)
        if skip_bias_add and not bias:
            raise ValueError("skip_bias_add needs a bias")
        self.in_features, self.num_parts = in_features, num_parts
        self.out_features = num_parts * sum(self.widths)
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        layouts = self.param_layouts(self.widths)
        if weight is None:
            full = (self.out_features, in_features)
            weight = _new_weight(full[::-1] if self.transposed else full, device, dtype)
        self.weight = shard_parameter(weight, layouts["weight"])
        if bias and bias_ is None:
            bias_ = nn.Parameter(torch.zeros(self.out_features, device=device, dtype=dtype))
        self.bias = shard_parameter(bias_, layouts["bias"]) if bias_ is not None else None

    def param_layouts(self, widths: Sequence[int]) -> dict[str, ShardLayout]:
        widths = tuple(widths)
        weight_dim = 1 if self.transposed else 0
        return {
            "weight": ShardLayout(weight_dim, widths, self.group, self.num_parts),
            "bias": ShardLayout(0, widths, self.group, self.num_parts),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        weight = self.weight.t() if self.transposed else self.weight
        bias = None if self.skip_bias_add else self.bias
        if self.op_active():
            y_local = self._local_linear(copy_to_group(x, group=self.group), weight, bias)
        else:  # the gradient's all-reduce overlaps the weight gradient (layers/overlap.py)
            y_local = column_linear(x, weight, bias, group=self.group)
        y = self._gather(y_local) if self.gather_output else y_local
        if self.skip_bias_add:
            assert self.bias is not None  # checked in __init__
            return y, self.bias
        return y

    def _gather(self, y_local: torch.Tensor) -> torch.Tensor:
        fused = [self.num_parts * w for w in self.widths]
        y = all_gather_uneven(y_local, -1, fused, group=self.group)
        if self.num_parts == 1:
            return y
        return merge_shards(y.split(fused, -1), -1, self.widths, self.num_parts)

    @classmethod
    def _from_native(
        cls, module: nn.Module, process_group: Any, widths: Sequence[int], **kwargs: Any
    ) -> _ColumnParallel:
        from colossalai.lazy import LazyInitContext

        LazyInitContext.materialize(module)
        group = single_group(process_group)
        in_features, out_features = _features(module, cls.transposed)
        num_parts = kwargs.get("num_parts", 1)
        if num_parts * sum(widths) != out_features:
            raise ValueError(
                f"{type(module).__name__} has {out_features} output features; widths "
                f"{list(widths)} x {num_parts} parts cover {num_parts * sum(widths)}"
            )
        return cls(
            in_features,
            widths,
            group=group,
            bias=module.bias is not None,
            weight=module.weight,
            bias_=module.bias,
            **kwargs,
        )


class _RowParallel(ResizableParallelModule):
    transposed = False

    def __init__(
        self,
        widths: Sequence[int],
        out_features: int,
        *,
        group: ProcessGroup,
        bias: bool = True,
        parallel_input: bool = True,
        weight: nn.Parameter | None = None,
        bias_: nn.Parameter | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(widths, group=group)
        self.in_features, self.out_features = sum(self.widths), out_features
        self.parallel_input = parallel_input
        if weight is None:
            full = (out_features, self.in_features)
            weight = _new_weight(full[::-1] if self.transposed else full, device, dtype)
        self.weight = shard_parameter(weight, self.param_layouts(self.widths)["weight"])
        if bias and bias_ is None:
            bias_ = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        self.bias = bias_ if bias else None  # replicated: added once, after the all-reduce

    def param_layouts(self, widths: Sequence[int]) -> dict[str, ShardLayout]:
        weight_dim = 0 if self.transposed else 1
        return {"weight": ShardLayout(weight_dim, tuple(widths), self.group)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.parallel_input:
            x = split_uneven(x, -1, self.widths, group=self.group)
        weight = self.weight.t() if self.transposed else self.weight
        if self.op_active():
            y = all_reduce(self._local_linear(x, weight, None), group=self.group)
        else:
            y = row_linear(x, weight, group=self.group)
        return y if self.bias is None else y + self.bias

    @classmethod
    def _from_native(
        cls, module: nn.Module, process_group: Any, widths: Sequence[int], **kwargs: Any
    ) -> _RowParallel:
        from colossalai.lazy import LazyInitContext

        LazyInitContext.materialize(module)
        group = single_group(process_group)
        in_features, out_features = _features(module, cls.transposed)
        if sum(widths) != in_features:
            raise ValueError(
                f"{type(module).__name__} has {in_features} input features; widths "
                f"{list(widths)} cover {sum(widths)}"
            )
        return cls(
            widths,
            out_features,
            group=group,
            bias=module.bias is not None,
            weight=module.weight,
            bias_=module.bias,
            **kwargs,
        )


def _features(module: nn.Module, transposed: bool) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear ([N, K]) or HF Conv1D ([K, N]) weight.

    A weight already sharded (tied to a layer replaced before) counts with its full shape.
    """
    rows, cols = full_shape(module.weight)
    return (rows, cols) if transposed else (cols, rows)


class ResizableLinearCol(_ColumnParallel):
    """Column-parallel nn.Linear: output features split by ``widths`` (see module docstring).

    Replaces colossalai's Linear1D_Col. ``num_parts`` > 1 splits fused outputs part by part.
    """

    @staticmethod
    def from_native_module(
        module: nn.Module, process_group: Any, *, widths: Sequence[int], **kwargs: Any
    ) -> ResizableLinearCol:
        """Shard ``module`` (an nn.Linear) in place; kwargs: gather_output, skip_bias_add, ..."""
        return ResizableLinearCol._from_native(module, process_group, widths, **kwargs)


class ResizableLinearRow(_RowParallel):
    """Row-parallel nn.Linear: input features split by ``widths`` (see module docstring).

    Replaces colossalai's Linear1D_Row.
    """

    @staticmethod
    def from_native_module(
        module: nn.Module, process_group: Any, *, widths: Sequence[int], **kwargs: Any
    ) -> ResizableLinearRow:
        """Shard ``module`` (an nn.Linear) in place; kwargs: parallel_input."""
        return ResizableLinearRow._from_native(module, process_group, widths, **kwargs)


class ResizableConv1DCol(_ColumnParallel):
    """Column-parallel GPT-2 Conv1D (weight [K, N]); ``num_parts=3`` for the fused c_attn.

    With fused Q|K|V each part is split by the same widths (heads x head_dim per rank), so
    rank r computes [Q_r, K_r, V_r]. Replaces colossalai's GPT2FusedLinearConv1D_Col.
    """

    transposed = True

    @staticmethod
    def from_native_module(
        module: nn.Module, process_group: Any, *, widths: Sequence[int], **kwargs: Any
    ) -> ResizableConv1DCol:
        """Shard ``module`` (a transformers Conv1D) in place; kwargs: num_parts, gather_output."""
        return ResizableConv1DCol._from_native(module, process_group, widths, **kwargs)


class ResizableConv1DRow(_RowParallel):
    """Row-parallel GPT-2 Conv1D (weight [K, N] split along K).

    Replaces colossalai's GPT2FusedLinearConv1D_Row.
    """

    transposed = True

    @staticmethod
    def from_native_module(
        module: nn.Module, process_group: Any, *, widths: Sequence[int], **kwargs: Any
    ) -> ResizableConv1DRow:
        """Shard ``module`` (a transformers Conv1D) in place; kwargs: parallel_input."""
        return ResizableConv1DRow._from_native(module, process_group, widths, **kwargs)
