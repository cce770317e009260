"""The one module that names CUDA. Everything else asks here for devices and backends."""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

from colossal_hetero.config.schema import DeviceKind

HOST_BACKEND = "gloo"
"""The backend of host-tensor groups: CPU ranks', and the control groups beside a GPU run's."""
P2P_DEVICE_BACKENDS = ("nccl", "hccl")
"""Backends (``ProcessGroup.name()``) whose pipeline p2p takes accelerator tensors: NCCL, and
HCCL on Ascend NPUs (a group of that name exists only with torch_npu)."""


def cuda_device_count() -> int:
    """Visible CUDA devices (0 on a CPU-only host or a CUDA build without a GPU)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(kind: DeviceKind, local_rank: int, local_world_size: int) -> torch.device:
    """The device this rank computes on.

    ``auto`` picks CUDA when there is one GPU per local rank, else CPU. ``cuda`` without enough
    GPUs is a user error.
    """
    num_gpus = cuda_device_count()
    if kind == "cpu" or (kind == "auto" and num_gpus < local_world_size):
        return host_device()
    if num_gpus < local_world_size:
        raise ValueError(
            f"cluster.device: 'cuda' needs {local_world_size} GPUs on this node, found {num_gpus}"
        )
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """torch.distributed backend for a device: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else HOST_BACKEND


def backend_for_kind(kind: DeviceKind) -> str | None:
    """The backend a configured ``cluster.device`` kind will use (see ``backend_for``), or
    None for auto (known only at run time, from the devices found)."""
    return {"cuda": "nccl", "cpu": HOST_BACKEND}.get(kind)


def kind_needs_accelerator(kind: DeviceKind) -> bool:
    """Whether a configured ``cluster.device`` kind runs on a backend that takes device tensors
    only (:func:`backend_needs_accelerator`); False for auto (decided at run time)."""
    backend = backend_for_kind(kind)
    return backend is not None and backend_needs_accelerator(backend)


def is_host_backend(backend: str) -> bool:
    """Whether ``backend`` (``dist.get_backend``'s string) is :data:`HOST_BACKEND`: host
    tensors, and each point-to-point operation progressing on its own."""
    return str(backend).lower() == HOST_BACKEND


def p2p_needs_device_tensors(backend_name: str) -> bool:
    """Whether Colossal-AI's pipeline p2p must stage tensors on the accelerator for a group
    whose ``ProcessGroup.name()`` is ``backend_name`` (:data:`P2P_DEVICE_BACKENDS`)."""
    return backend_name.lower() in P2P_DEVICE_BACKENDS


def accelerator_device() -> torch.device:
    """This process's current CUDA device (the one :func:`bind_device` made current)."""
    return torch.device("cuda", torch.cuda.current_device())


def backend_needs_accelerator(backend: str) -> bool:
    """Whether a group of ``backend`` (``dist.get_backend``'s string) takes device tensors only:
    NCCL alone does; gloo and a mixed ``cpu:gloo,cuda:nccl`` group take host tensors."""
    return str(backend).lower() == "nccl"


def current_device() -> torch.device:
    """The device this process computes on: Colossal-AI's accelerator's current device (the
    current CUDA device on a GPU run, the host under the CPU accelerator we install)."""
    from colossalai.accelerator import get_accelerator

    return torch.device(get_accelerator().get_current_device())


def deepspeed_accelerator_name(device: torch.device) -> str:
    """DeepSpeed's accelerator name (its ``DS_ACCELERATOR``) for ranks computing on ``device``."""
    return "cpu" if is_host_device(device) else "cuda"


def host_device() -> torch.device:
    """The host (CPU) device: where host-backend (gloo) tensors live."""
    return torch.device("cpu")


def collective_device(group: Any = None) -> torch.device:
    """The device a collective on ``group`` (None: the world) needs its tensors on: the
    current accelerator for an NCCL group, the host otherwise."""
    if backend_needs_accelerator(dist.get_backend(group)):
        return accelerator_device()
    return host_device()


def no_accelerator_env() -> dict[str, str]:
    """Environment entries that hide every GPU from a child process (it then runs on CPU)."""
    return {"CUDA_VISIBLE_DEVICES": ""}


def bind_device(device: torch.device) -> None:
    """Make ``device`` the current device of this process (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def is_host_device(device: torch.device) -> bool:
    """Whether ``device`` is the host (CPU), not an accelerator."""
    return device.type == "cpu"


def waits_block_host(device: torch.device) -> bool:
    """Whether a communication work's ``wait()`` for tensors on ``device`` blocks the host
    until its data has moved (host backends); an accelerator's returns at once, having only
    ordered the current stream after the transfer."""
    return is_host_device(device)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on ``device``, so wall-clock timings are true (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_memory_allocated(device: torch.device) -> int:
    """Peak bytes allocated by torch on ``device``; 0 where torch does not track it (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return 0


def available_memory_bytes(device: torch.device, local_world_size: int = 1) -> int:
    """Bytes this rank could still allocate on ``device``: the GPU's free memory on CUDA; on
    CPU the host's ``MemAvailable`` (``/proc/meminfo``) split evenly among the
    ``local_world_size`` ranks sharing the host (0 where the kernel does not say)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // max(1, local_world_size)
    except OSError:
        pass
    return 0


DEPRECATED_AMP_WARNING = r"`torch\.cuda\.amp\.custom_"
"""Opening words of torch's FutureWarning for the GPU backend's deprecated ``amp.custom_fwd`` /
``custom_bwd`` decorators, which Colossal-AI's MoE ops still use (``utils.quiet`` filters it
at that source)."""
SUPPORTED_DEVICE_TYPES = ("cuda", "cpu")
"""Device types the plugin runs on (what Booster's ``supported_devices`` reports)."""


def device_name(device: torch.device) -> str:
    """The GPU's product name (``NVIDIA H100 80GB HBM3``), or ``cpu``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_kind(device: torch.device) -> DeviceKind:
    """The ``cluster.device`` value that names ``device``'s type."""
    return "cuda" if device.type == "cuda" else "cpu"


def has_side_streams(device: torch.device) -> bool:
    """Whether collectives can overlap compute on separate streams (CUDA), not on CPU."""
    return device.type == "cuda"


def local_device(local_rank: int, local_world_size: int) -> torch.device:
    """One GPU per local rank when there are enough of them, else the CPU (``auto``)."""
    return resolve_device("auto", local_rank, local_world_size)


def detected_device_kind(local_world_size: int) -> DeviceKind:
    """``cuda`` when every local rank can have its own GPU, else ``cpu``."""
    return "cuda" if cuda_device_count() >= local_world_size else "cpu"


def set_device_ignoring_cpu(device: Any) -> None:
    """``torch.cuda.set_device`` as Colossal-AI's modeling code means it when it passes a
    tensor's device: an index or CUDA device becomes current, a CPU device is ignored."""
    bind_device(device if isinstance(device, torch.device) else torch.device("cuda", device))


def torch_view_without_cpu_set_device() -> types.ModuleType:
    """A ``torch`` stand-in whose ``cuda.set_device`` is :func:`set_device_ignoring_cpu`;
    every other attribute is torch's own."""

    class _Cuda(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch.cuda, name)

    class _Torch(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    cuda = _Cuda("torch.cuda")
    cuda.set_device = set_device_ignoring_cpu  # type: ignore[attr-defined]
    view = _Torch("torch")
    view.cuda = cuda  # type: ignore[attr-defined]
    return view
