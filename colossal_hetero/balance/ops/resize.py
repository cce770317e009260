"""ZERO-resizing: a straggler computes only a kept subset of a layer's reduction dimension.

Attached to a resizable layer as its ``local_op`` (layers/linear.py), so the layer's own
collectives (copy_to_group / all-gather for column-parallel, the all-reduce for row-parallel)
run unchanged and see the same shapes on every rank.

On the straggler, with kept columns P and dropped D of the K reduction columns:
    y = x[..., P] @ W[:, P]^T (+ b)                       (GEMMs on the smaller matrices)
    dx[..., P] = dy @ W[:, P],   dW[:, P] = dy^T x[..., P],   db = sum dy (exact)
    dx[..., D] = dW[:, D] = impute_value

Imputation (``impute``):
- ``"zero"`` (the default): dx[..., D] = dW[:, D] = ``impute_value`` (0 by default) and no
  forward term. For column-parallel dx the straggler's entry is one term of the all-reduced
  sum, so 0 means "no contribution" and the other ranks' terms stay exact; for dW, 0 makes
  plain SGD leave a dropped column where it is. 1e-18 reproduces the authors' code.
- ``"mean"``: each dropped input feature is imputed by its mean over the
  step's tokens, mu_D = mean_t x[t, D], so the straggler computes
      y = x[..., P] @ W[:, P]^T + (mu_D @ W[:, D]^T) (+ b)
  and its gradients are the exact gradients of that function:
      dx[..., D] = (sum_t dy_t) @ W[:, D] / T   (the same row for every token),
      dW[:, D] = (sum_t dy_t)^T mu_D            (a rank-1 outer product).
  The forward error falls from x_D W_D^T to (x_D - mu_D) W_D^T: after LayerNorm or GELU a
  feature's mean is far from 0, and it is the part a layer's output leans on most. Extra
  work: O(T |D| + N |D|) against the O(T N |D|) saved in each of the three GEMMs. Not the
  default: on the digits ViT (docs/balancing-ops.md) it ended with a higher held-out loss
  than zero imputation on each of 5 seeds, the accuracy the same within the seeds' spread.
A stale (last computed) gradient was rejected: it would push a column again and again in a
direction measured at old weights. Momentum and weight decay still move a dropped column
unless the optimizer step runs inside :func:`frozen_columns`.

Return of frozen columns (:func:`freeze_on_step`, ``on_return``). When a layer's op comes
off (recovery, a probe), its dropped columns come back with the weights they had when
dropped, while the rest of the network trained for a while without them: the function
jumps. ``"zero"`` (the default) restarts them: weight 0 and first moments (``exp_avg``,
``momentum_buffer``) 0, so the function right after the return is the one trained, and the
columns regrow from the current gradient. Second moments are kept: with Adam's step count
still advancing, a zeroed ``exp_avg_sq`` would undo its bias correction for these entries
(steps up to ~3x the learning rate). Only columns that were out of the function while
dropped (their gradient exactly 0 at every frozen step: zero imputation, no tied use such as
GPT-2's embedding) are restarted; the others keep their weights (``"keep"`` keeps all).

Every other rank runs the plain ``F.linear``; the op is inactive in eval and under no_grad
(the layer checks, see ``ResizableParallelModule._local_linear``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from colossal_hetero.layers.linear import (
    ResizableConv1DCol,
    ResizableLinearCol,
    ResizableParallelModule,
)


def reduction_width(layer: ResizableParallelModule, rank: int) -> int:
    """K on ``rank``: in_features for column-parallel, that rank's width for row-parallel."""
    if isinstance(layer, (ResizableLinearCol, ResizableConv1DCol)):
        return int(layer.in_features)
    return int(layer.widths[rank])


def reduction_dim(layer: ResizableParallelModule) -> int:
    """The reduction dimension of ``layer.weight`` as stored (0 for Conv1D's [K, N], else 1)."""
    return 0 if getattr(layer, "transposed", False) else 1


def check_columns(indices: torch.Tensor, width: int, field: str) -> None:
    """ValueError unless ``indices`` is a sorted, duplicate-free LongTensor within [0, width)."""
    if indices.dtype != torch.long or indices.dim() != 1:
        raise ValueError(f"{field} must be a 1-D LongTensor")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= width):
        raise ValueError(f"{field} must lie in [0, {width})")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise ValueError(f"{field} must be sorted and without duplicates")


def complement(indices: torch.Tensor, width: int) -> torch.Tensor:
    """range(width) minus ``indices``, sorted (LongTensor on the same device)."""
    mask = torch.ones(width, dtype=torch.bool, device=indices.device)
    mask[indices] = False
    return mask.nonzero().flatten()


class _ResizedLinear(torch.autograd.Function):
    """F.linear over the kept columns only; gradients in full shape with imputed entries."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, kept, impute_value):  # type: ignore[override]
        x_kept, w_kept = x.index_select(-1, kept), weight.index_select(1, kept)
        ctx.save_for_backward(x_kept, w_kept, kept)
        ctx.meta = (x.shape, weight.shape, impute_value, bias is not None)
        return F.linear(x_kept, w_kept, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        x_kept, w_kept, kept = ctx.saved_tensors
        x_shape, w_shape, impute_value, has_bias = ctx.meta
        dx = dw = db = None
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[0]:
            dx = dy.new_full(x_shape, impute_value)
            dx.index_copy_(dx.dim() - 1, kept, dy @ w_kept)
        if ctx.needs_input_grad[1]:
            dw = dy.new_full(w_shape, impute_value)
            dw.index_copy_(1, kept, dy2.t() @ x_kept.reshape(-1, x_kept.shape[-1]))
        if has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None


class _MeanImputedLinear(torch.autograd.Function):
    """F.linear with the dropped columns' inputs replaced by their mean over the tokens."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, kept, dropped):  # type: ignore[override]
        x_kept, w_kept = x.index_select(-1, kept), weight.index_select(1, kept)
        w_drop = weight.index_select(1, dropped)
        # every column's token mean, then the dropped ones: reads x once, copies nothing
        mean = x.reshape(-1, x.shape[-1]).mean(0).index_select(0, dropped)
        shift = F.linear(mean, w_drop)  # [N]: the imputed features' contribution
        ctx.save_for_backward(x_kept, w_kept, w_drop, mean, kept, dropped)
        ctx.meta = (x.shape, weight.shape, bias is not None)
        return F.linear(x_kept, w_kept, shift if bias is None else bias + shift)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        x_kept, w_kept, w_drop, mean, kept, dropped = ctx.saved_tensors
        x_shape, w_shape, has_bias = ctx.meta
        dx = dw = db = None
        dy2 = dy.reshape(-1, dy.shape[-1])
        dy_sum = dy2.sum(0)  # [N]; the bias gradient, and the dropped entries' factor
        if ctx.needs_input_grad[0]:
            dx = dy.new_empty(x_shape)
            dx.index_copy_(dx.dim() - 1, kept, dy @ w_kept)
            tokens = dy2.shape[0]
            row = (dy_sum @ w_drop) / tokens  # d(mean)/dx_t = 1 / T for every token t
            dx.index_copy_(dx.dim() - 1, dropped, row.expand(*x_shape[:-1], row.numel()))
        if ctx.needs_input_grad[1]:
            dw = dy.new_empty(w_shape)
            dw.index_copy_(1, kept, dy2.t() @ x_kept.reshape(-1, x_kept.shape[-1]))
            dw.index_copy_(1, dropped, torch.outer(dy_sum, mean))
        if has_bias and ctx.needs_input_grad[2]:
            db = dy_sum
        return dx, dw, db, None, None


def mean_imputed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kept: torch.Tensor,
    dropped: torch.Tensor,
) -> torch.Tensor:
    """x [*, K], weight [N, K], bias [N] | None; ``kept`` and ``dropped`` partition range(K)
    -> y [*, N] = x[..., P] W[:, P]^T + mean_t(x[t, D]) W[:, D]^T (+ b), exact gradients of it."""
    return _MeanImputedLinear.apply(x, weight, bias, kept, dropped)


def resized_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kept: torch.Tensor,
    impute_value: float = 0.0,
) -> torch.Tensor:
    """x [*, K], weight [N, K], bias [N] | None, kept [|P|] -> y [*, N] over the kept columns."""
    return _ResizedLinear.apply(x, weight, bias, kept, impute_value)


IMPUTE_MODES = ("mean", "zero")
"""How a ZERO-resized straggler fills in its dropped columns (see the module docstring)."""


class ZeroResize:
    """``local_op`` that ZERO-resizes rank ``straggler``'s GEMM to the ``kept`` columns.

    ``kept``: sorted LongTensor within [0, K) of the straggler (see :func:`reduction_width`),
    identical on every rank. With every column kept the plain F.linear runs (bitwise stock).
    ``impute``: ``"mean"`` or ``"zero"`` (then ``impute_value`` fills the dropped gradients).
    """

    def __init__(
        self,
        straggler: int,
        kept: torch.Tensor,
        *,
        impute: str = "zero",
        impute_value: float = 0.0,
    ) -> None:
        if impute not in IMPUTE_MODES:
            raise ValueError(f"impute must be one of {IMPUTE_MODES}, got {impute!r}")
        self.straggler, self.kept = straggler, kept
        self.impute, self.impute_value = impute, impute_value

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer: ResizableParallelModule,
    ) -> torch.Tensor:
        if layer.rank != self.straggler or self.kept.numel() == weight.shape[1]:
            return F.linear(x, weight, bias)
        kept = self.kept.to(x.device)
        if self.impute == "mean":
            dropped = complement(kept, weight.shape[1])
            return mean_imputed_linear(x, weight, bias, kept, dropped)
        return resized_linear(x, weight, bias, kept, self.impute_value)

    def dropped(self, layer: ResizableParallelModule) -> torch.Tensor:
        """The straggler's dropped columns (empty on other ranks)."""
        if layer.rank != self.straggler:
            return torch.empty(0, dtype=torch.long)
        return complement(self.kept.cpu(), reduction_width(layer, layer.rank))


def attach_resize(
    layer: ResizableParallelModule,
    straggler: int,
    kept: torch.Tensor,
    *,
    impute: str = "zero",
    impute_value: float = 0.0,
) -> ZeroResize:
    """Check ``kept`` (on every rank, before any collective) and set it as ``layer.local_op``."""
    if not 0 <= straggler < len(layer.widths):
        raise ValueError(f"straggler must be a rank of the layer's group, got {straggler}")
    check_columns(kept.cpu(), reduction_width(layer, straggler), "kept")
    op = ZeroResize(straggler, kept, impute=impute, impute_value=impute_value)
    layer.local_op = op
    return op


def freeze_targets(
    layers: Sequence[ResizableParallelModule],
) -> list[tuple[nn.Parameter, int, torch.Tensor]]:
    """(weight, reduction dim, dropped columns) of each ZERO-resized layer on this rank."""
    targets = []
    for layer in layers:
        op = layer.local_op
        if isinstance(op, ZeroResize):
            dropped = op.dropped(layer)
            if dropped.numel():
                weight = layer.weight
                targets.append((weight, reduction_dim(layer), dropped.to(weight.device)))
    return targets


@contextmanager
def frozen_columns(
    optimizer: torch.optim.Optimizer,
    targets: Sequence[tuple[nn.Parameter, int, torch.Tensor]],
) -> Iterator[None]:
    """Run an optimizer step with the ``targets``' columns frozen: param and state restored.

    ``targets``: (param, dim, columns). Every optimizer state tensor shaped like the param
    (momentum, Adam's moments, AMSGrad's max) gets its columns back; one created by this step
    gets them zeroed (torch optimizers start from zeros). Scalar state (Adam's step count) is
    shared by all columns and does advance.
    """
    saved = []
    for param, dim, cols in targets:
        state = optimizer.state.get(param, {})
        old = {
            k: v.index_select(dim, cols).clone()
            for k, v in state.items()
            if torch.is_tensor(v) and v.shape == param.shape
        }
        saved.append((param, dim, cols, param.detach().index_select(dim, cols).clone(), old))
    yield
    with torch.no_grad():
        for param, dim, cols, values, old in saved:
            param.index_copy_(dim, cols, values)
            for key, value in optimizer.state.get(param, {}).items():
                if torch.is_tensor(value) and value.shape == param.shape:
                    if key in old:
                        value.index_copy_(dim, cols, old[key])
                    else:
                        value.index_fill_(dim, cols, 0)


FreezeTargets = list[tuple[nn.Parameter, int, torch.Tensor]]

RETURN_POLICIES = ("keep", "zero")
"""What :func:`freeze_on_step` does with a layer's frozen columns when its op comes off."""
FIRST_MOMENTS = ("exp_avg", "momentum_buffer")
"""Optimizer state keys restarted at 0 with a returning column (torch AdamW/Adam, SGD)."""


@dataclass
class _Dropped:
    """One parameter's columns frozen at the last step, and whether they stayed out of the
    function (gradient exactly 0 there at every frozen step since they were first dropped)."""

    param: nn.Parameter
    dim: int
    cols: torch.Tensor
    unused: bool


def restart_columns(
    optimizer: torch.optim.Optimizer, param: nn.Parameter, dim: int, cols: torch.Tensor
) -> None:
    """``param``'s ``cols`` along ``dim`` and their first moments (``FIRST_MOMENTS``) set to 0;
    every other state (second moments, step counts) kept."""
    with torch.no_grad():
        param.index_fill_(dim, cols, 0)
        state = optimizer.state.get(param, {})
        for key in FIRST_MOMENTS:
            value = state.get(key)
            if torch.is_tensor(value) and value.shape == param.shape:
                value.index_fill_(dim, cols, 0)


def _track_returns(
    optimizer: torch.optim.Optimizer,
    frozen: FreezeTargets,
    dropped: dict[int, _Dropped],
) -> None:
    """Restart the columns of every parameter frozen at the last step and not now (its op
    came off) if they stayed out of the function; then record this step's frozen columns."""
    now = {id(param) for param, _, _ in frozen}
    for key in [k for k in dropped if k not in now]:
        entry = dropped.pop(key)
        live = any(p is entry.param for g in optimizer.param_groups for p in g["params"])
        fits = entry.cols.numel() == 0 or int(entry.cols.max()) < entry.param.shape[entry.dim]
        if entry.unused and live and fits:
            restart_columns(optimizer, entry.param, entry.dim, entry.cols)
    for param, dim, cols in frozen:
        grad = param.grad
        unused = grad is None or not bool(grad.index_select(dim, cols).any())
        held = dropped.get(id(param))
        if held is None or held.param is not param or held.dim != dim:
            dropped[id(param)] = _Dropped(param, dim, cols, unused)
        else:
            held.cols, held.unused = cols, held.unused and unused


def freeze_on_step(
    optimizer: Any, targets: Callable[[], FreezeTargets], *, on_return: str = "zero"
) -> None:
    """Wrap the inner optimizer's ``step`` (``optimizer.optim`` under a booster's wrapper,
    else ``optimizer``; the instance's method) so that each step runs under
    ``frozen_columns(targets())``: no momentum or weight-decay drift in dropped columns.

    ``on_return`` (``RETURN_POLICIES``): at the first step at which a parameter has no
    frozen columns any more, ``"zero"`` restarts the columns frozen at the step before
    (:func:`restart_columns`; only those whose gradient was 0 at every frozen step),
    ``"keep"`` leaves them as they were. See the module docstring."""
    if on_return not in RETURN_POLICIES:
        raise ValueError(f"on_return must be one of {RETURN_POLICIES}, got {on_return!r}")
    inner = getattr(optimizer, "optim", optimizer)
    original = inner.step
    dropped: dict[int, _Dropped] = {}  # by id(param), the param held: the last step's columns

    @functools.wraps(original)
    def step(*args: Any, **kwargs: Any) -> Any:
        frozen = targets()
        if on_return == "zero":
            _track_returns(inner, frozen, dropped)
        if not frozen:
            return original(*args, **kwargs)
        with frozen_columns(inner, frozen):
            return original(*args, **kwargs)

    inner.step = step
