"""Make Colossal-AI 0.5's hybrid-parallel training run on CPU processes over gloo.

Colossal-AI targets GPUs; on a CPU-only host its CPU accelerator raises for every device, RNG
and stream call, and a few modules call the GPU backend directly. Each fix below is small, named
and tested
(tests/distributed/test_cpu_support.py has one check per fix that fails without it).

Contract:
- ``apply_cpu_support()`` is called explicitly (the plugin calls it when its device is CPU).
- It is idempotent: a second call changes nothing.
- It only touches CPU code paths: the ``CpuAccelerator`` class, the gloo branch of pipeline p2p,
  a ZeRO sanity check that rejected the CPU accelerator (and ZeRO's stream overlap, which CPU
  tensors cannot join), GPU-only ``set_device`` calls in shardformer modeling code, which
  become no-ops for CPU tensors (``utils.device.set_device_ignoring_cpu``), and the gloo branch
  of the GPT-2 fused-QKV gather. GPU runs take exactly the code paths they took before.

Upstream: hpcaitech/ColossalAI issue #5211 (Randomizer on CPU), #2827 (CPU debugging); the
proposed fix (PR #5265) was never merged.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

_MARK = "_colossal_hetero_cpu_support"

# Shardformer modeling modules that call the GPU backend's set_device(hidden_states.device).
_MODELING_MODULES = (
    "colossalai.shardformer.modeling.gpt2",
    "colossalai.shardformer.modeling.gptj",
    "colossalai.shardformer.modeling.opt",
    "colossalai.shardformer.modeling.t5",
)


class _NullStream:
    """Stand-in for a device stream on CPU, where every op is synchronous."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullEvent:
    """Stand-in for a device event on CPU: recorded work is always complete."""

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _cpu_accelerator_methods() -> dict[str, Callable[..., Any]]:
    """Replacements for CpuAccelerator methods that raise or are wrong on CPU."""
    from colossal_hetero.utils.device import host_device

    def noop(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    return {
        # torch.get_rng_state() takes no device argument: the stock method raises TypeError.
        "get_rng_state": lambda self, device=None: torch.get_rng_state(),
        "set_rng_state": lambda self, new_state, device=None: torch.set_rng_state(new_state),
        "get_rng_state_all": lambda self: [torch.get_rng_state()],
        "set_rng_state_all": lambda self, new_states: torch.set_rng_state(new_states[0]),
        "manual_seed": lambda self, seed: torch.manual_seed(seed),
        "manual_seed_all": lambda self, seed: torch.manual_seed(seed),
        "seed": lambda self: torch.seed(),
        "seed_all": lambda self: torch.seed(),
        "initial_seed": lambda self: torch.initial_seed(),
        # A device object works wherever Colossal-AI passes current_device() as `device=`.
        "current_device": lambda self: host_device(),
        "set_device": noop,
        "synchronize": noop,
        "empty_cache": noop,
        "device_count": lambda self: 1,
        "Stream": lambda self, device=None, priority=0, **kwargs: _NullStream(),
        "Event": lambda self, enable_timing=False, blocking=False, interprocess=False: _NullEvent(),
        "current_stream": lambda self, device=None: _NullStream(),
        "default_stream": lambda self, device=None: _NullStream(),
        "set_stream": noop,
        "stream": lambda self, stream_: contextlib.nullcontext(),
    }


def _patch_cpu_accelerator() -> None:
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    if getattr(CpuAccelerator, _MARK, False):
        return
    for name, fn in _cpu_accelerator_methods().items():
        setattr(CpuAccelerator, name, fn)
    setattr(CpuAccelerator, _MARK, True)


def _is_nccl_like(group: Any) -> bool:
    """Whether pipeline p2p must stage tensors on the accelerator (NCCL/HCCL groups only).

    The stock check evaluates ``torch.distributed.Backend.HCCL`` and ``is_hccl_available``,
    which exist only with torch_npu, so any gloo group raised AttributeError.
    """
    from torch.distributed import distributed_c10d as c10d

    from colossal_hetero.utils.device import p2p_needs_device_tensors

    pg: Any = group or c10d._get_default_group()
    wrapper: Any = getattr(c10d, "_ProcessGroupWrapper", None)
    while wrapper is not None and isinstance(pg, wrapper):
        pg = pg.wrapped_pg
    return p2p_needs_device_tensors(pg.name())


def _patch_pipeline_p2p() -> None:
    from colossalai.pipeline import p2p

    if getattr(p2p, _MARK, False):
        return
    p2p._check_for_nccl_hccl_backend = _is_nccl_like
    setattr(p2p, _MARK, True)


def _zero_sanity_checks(self: Any) -> None:
    """ZeRO's dtype check, without the assertion that the accelerator is a GPU or an NPU."""
    for param_group in self.optim.param_groups:
        for param in param_group["params"]:
            if getattr(param, "skip_zero_check", False):
                continue
            if param.dtype != self._dtype:
                raise ValueError(
                    f"ZeRO expects every parameter in {self._dtype}, got one in {param.dtype}"
                )


def _without_comm_overlap(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap ZeRO's __init__ so that gradient-reduction overlap is off.

    Overlap needs a side stream and ``Tensor.record_stream``, which CPU tensors reject
    ("unknown parameter type"); on CPU every collective is synchronous anyway.
    """
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["overlap_communication"] = False
        init(*bound.args, **bound.kwargs)

    return wrapped


def _patch_zero() -> None:
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    if getattr(LowLevelZeroOptimizer, _MARK, False):
        return
    LowLevelZeroOptimizer._sanity_checks = _zero_sanity_checks
    LowLevelZeroOptimizer.__init__ = _without_comm_overlap(LowLevelZeroOptimizer.__init__)
    setattr(LowLevelZeroOptimizer, _MARK, True)


def _patch_modeling_set_device() -> None:
    import importlib

    from colossal_hetero.utils.device import torch_view_without_cpu_set_device

    view = None
    for name in _MODELING_MODULES:
        module = importlib.import_module(name)
        if getattr(module, _MARK, False):
            continue
        view = view or torch_view_without_cpu_set_device()
        setattr(module, "torch", view)  # noqa: B010 (the module's global, read at call time)
        setattr(module, _MARK, True)


def _gather_fused_qkv(
    stock: Callable[..., torch.Tensor],
) -> Callable[..., torch.Tensor]:
    """GPT-2 fused-QKV gather that works on gloo groups.

    The stock function moves the shard to the GPU unconditionally, so saving a TP-sharded
    GPT-2 state dict fails on CPU. NCCL groups still take the stock path.

    Each rank holds ``[Q_r, K_r, V_r]`` (every part ``split_sizes[i] / world`` wide along the
    feature dim: the last one when ``is_transposed``); the result is ``[Q_0..Q_n, K_0.., V_0..]``.
    """

    def gather(
        qkv: torch.Tensor, split_sizes: list[int], process_group: Any, is_transposed: bool = False
    ) -> torch.Tensor:
        if _is_nccl_like(process_group):
            return stock(qkv, split_sizes, process_group, is_transposed)
        import torch.distributed as dist

        world = dist.get_world_size(process_group)
        dim = -1 if is_transposed else 0
        shards = [torch.empty_like(qkv) for _ in range(world)]
        dist.all_gather(shards, qkv.contiguous(), group=process_group)
        local_sizes = [size // world for size in split_sizes]
        parts = [shard.split(local_sizes, dim=dim) for shard in shards]
        return torch.cat([parts[r][i] for i in range(len(split_sizes)) for r in range(world)], dim)

    return gather


def _patch_fused_qkv_gather() -> None:
    from colossalai.shardformer.layer import qkv_fused_linear

    if getattr(qkv_fused_linear, _MARK, False):
        return
    stock = qkv_fused_linear.gather_fused_qkv_in_gpt2_style
    qkv_fused_linear.gather_fused_qkv_in_gpt2_style = _gather_fused_qkv(stock)
    setattr(qkv_fused_linear, _MARK, True)


def apply_cpu_support() -> None:
    """Install every CPU fix. Idempotent; call only when training on CPU."""
    _patch_cpu_accelerator()
    _patch_pipeline_p2p()
    _patch_zero()
    _patch_modeling_set_device()
    _patch_fused_qkv_gather()


def is_applied() -> bool:
    """Whether ``apply_cpu_support`` has run in this process."""
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    return bool(getattr(CpuAccelerator, _MARK, False))
