"""Sufficient factor broadcasting (SFB): data-parallel weight gradients from gathered factors.

For a linear module ``y = x W^T + b`` replicated over a data-parallel ``group``, each rank
all-gathers the *sufficient factors* of every rank, its inputs and output gradients, and
rebuilds the weight gradient itself instead of all-reducing it (Xie et al., UAI'16; HAP).
It pays when ``tokens * (in + out)`` is small next to ``in * out``.

Shape letters (R ranks in ``group``, this rank r):
    T_r tokens of rank r (any per rank, 0 included), T = sum_r T_r; K in, N out features.
    x_r [T_r, K]   the module's input;  dy_r [T_r, N] the gradient of its output.
    X [T, K], dY [T, N]   every rank's factors, concatenated in rank order.
    nn.Linear weight [N, K];  Hugging Face Conv1D (GPT-2) weight [K, N].

Gradients equal torch DDP's, which averages over the group:
    dW = dY^T X / R  ([N, K]; Conv1D: its transpose X^T dY / R),   db = sum_T dY / R,
so the bias syncs with the weight and both must be excluded from DDP
(:func:`exclude_from_ddp`). Every rank sums the same gathered factors in the same order, so
replicas stay bitwise equal. Autograd still computes the local dW; the hooks replace it.

Collectives, all on ``group``, during backward when a hooked module's output gradient
arrives (every rank reaches its modules in the same order): one all-gather of the token
counts T_r (R int64 values), then one uneven all-gather of ``[x_r | dy_r]`` [T_r, K + N]
(``method`` "padded" or "grouped", see :mod:`.primitives`).

Limits: a module called several times in one step sums all its calls (one weight hook per
backward); activation checkpointing that re-runs forwards inside backward is not supported.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from colossal_hetero.comm import primitives as prim
from colossal_hetero.comm.primitives import Method


def _is_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def check_sfb_module(name: str, module: nn.Module) -> None:
    """ValueError unless ``module`` is an nn.Linear or a Hugging Face Conv1D (2-D weight)."""
    if not isinstance(module, nn.Linear) and not _is_conv1d(module):
        raise ValueError(
            f"{name}: SFB syncs nn.Linear and transformers Conv1D modules, not "
            f"{type(module).__name__}"
        )


def sfb_param_names(model: nn.Module, module_names: Iterable[str]) -> list[str]:
    """Fully qualified names of the parameters SFB syncs: weight and bias of each module.

    Raises:
        ValueError: a name is not a module of ``model`` or not a supported module.
    """
    modules = dict(model.named_modules())
    names = []
    for name in module_names:
        if name not in modules:
            raise ValueError(f"{name}: not a module of {type(model).__name__}")
        check_sfb_module(name, modules[name])
        names += [f"{name}.{p}" for p, _ in modules[name].named_parameters(recurse=False)]
    return names


def exclude_from_ddp(model: nn.Module, param_names: Iterable[str]) -> None:
    """Make a torch DDP built later around ``model`` skip ``param_names`` (keeps earlier ones).

    DDP reads the list once, at construction: call this before wrapping.
    """
    names = {*getattr(model, "_ddp_params_and_buffers_to_ignore", ()), *param_names}
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(names))


@dataclass(frozen=True, slots=True)
class SfbHandle:
    """The hooks :func:`install_sfb` registered; ``remove()`` restores all-reduce-free
    modules (their gradients are then local again: re-wrap in DDP to sync them)."""

    handles: tuple[RemovableHandle, ...]

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self.handles:
            handle.remove()


class _ModuleSync:
    """The SFB hooks of one module: capture factors, gather them, hand autograd dW and db."""

    def __init__(self, module: nn.Module, group: ProcessGroup, method: Method) -> None:
        self.group, self.method = group, method
        self.weight: nn.Parameter = module.weight
        self.bias: nn.Parameter | None = module.bias
        self.transposed = _is_conv1d(module)
        self.in_features = self.weight.shape[0 if self.transposed else 1]
        # Gradients rebuilt for this backward, waiting for autograd to reach the parameters.
        self.pending: dict[str, torch.Tensor] = {}

    def register(self, module: nn.Module) -> list[RemovableHandle]:
        handles = [module.register_forward_hook(self._on_forward)]
        handles.append(self.weight.register_hook(lambda grad: self._take("weight", grad)))
        if self.bias is not None:
            handles.append(self.bias.register_hook(lambda grad: self._take("bias", grad)))
        return handles

    def _on_forward(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not (torch.is_grad_enabled() and output.requires_grad):
            return
        x_local = args[0].detach().reshape(-1, self.in_features)
        output.register_hook(lambda dy: self._on_output_grad(x_local, dy))

    def _on_output_grad(self, x_local: torch.Tensor, dy: torch.Tensor) -> None:
        dy_local = dy.detach().reshape(-1, dy.shape[-1]).to(x_local.dtype)
        x_all, dy_all = gather_factors(x_local, dy_local, group=self.group, method=self.method)
        scale = 1.0 / dist.get_world_size(self.group)
        grads = {"weight": (x_all.t() @ dy_all if self.transposed else dy_all.t() @ x_all) * scale}
        if self.bias is not None:
            grads["bias"] = dy_all.sum(0) * scale
        for key, grad in grads.items():  # a module called twice sums both calls
            self.pending[key] = self.pending[key] + grad if key in self.pending else grad

    def _take(self, key: str, local_grad: torch.Tensor) -> torch.Tensor:
        assert key in self.pending, "a parameter's gradient arrived before its output's"
        grad = self.pending.pop(key)
        return grad.to(local_grad.dtype)


def gather_factors(
    x_local: torch.Tensor,
    dy_local: torch.Tensor,
    *,
    group: ProcessGroup,
    method: Method = "padded",
) -> tuple[torch.Tensor, torch.Tensor]:
    """x_local [T_r, K], dy_local [T_r, N] -> X [T, K], dY [T, N]: every rank's, in rank order.

    Two all-gathers on ``group``: the token counts, then ``[x_local | dy_local]`` uneven.
    """
    if x_local.shape[0] != dy_local.shape[0]:
        raise ValueError(f"factors differ in tokens: {x_local.shape[0]} vs {dy_local.shape[0]}")
    size = dist.get_world_size(group)
    count = torch.tensor([x_local.shape[0]], dtype=torch.int64, device=x_local.device)
    counts = count.new_empty(size)
    dist.all_gather_into_tensor(counts, count, group=group)
    factors = torch.cat([x_local, dy_local], dim=1)
    gathered = prim.gather(factors, 0, counts.tolist(), group=group, method=method)
    return gathered.split([x_local.shape[1], dy_local.shape[1]], dim=1)


def install_sfb(
    model: nn.Module, methods: Mapping[str, Method], *, group: ProcessGroup
) -> SfbHandle:
    """Sync the gradients of ``model``'s modules named in ``methods`` by SFB over ``group``.

    ``methods`` maps module names (``model.named_modules()``) to how their factors are
    gathered ("padded" or "grouped"). The modules' parameters must not be synced by anything
    else (see :func:`exclude_from_ddp`). Every rank of ``group`` must install the same modules.

    Raises:
        ValueError: a name is not a module of ``model``, or not an nn.Linear / Conv1D.
    """
    if group is None:
        raise ValueError("group is required (None would silently mean the world group)")
    modules = dict(model.named_modules())
    for name, method in methods.items():  # check everything before registering anything
        if name not in modules:
            raise ValueError(f"{name}: not a module of {type(model).__name__}")
        check_sfb_module(name, modules[name])
        prim.check_method(method)
    handles: list[RemovableHandle] = []
    for name, method in methods.items():
        handles += _ModuleSync(modules[name], group, method).register(modules[name])
    return SfbHandle(tuple(handles))
