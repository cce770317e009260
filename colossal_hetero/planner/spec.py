"""What the planner plans for: the devices (ClusterSpec) and the layers of the model (ModelSpec).

Pure data, no torch. Units are SI throughout: FLOP/s, bytes, bytes/s, seconds. A model is a
chain of layers (the residual stream is described by flags on the layers that fork and join it),
which is what every transformer the plugin supports reduces to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

REFERENCE_FLOPS = 100e12
"""FLOP/s of a device with relative speed 1.0: the sustained (not peak) dense bf16 matmul rate of
an A100-class GPU, about a third of its 312 TFLOP/s peak. Only the ratio of compute to
communication time depends on it; measure it with ``colossal-hetero profile`` where it matters."""

DEFAULT_LATENCY_S = 10e-6
"""Seconds per message hop of a collective (ring step), a typical NCCL inter-node latency."""

DEFAULT_GROUPED_EFFICIENCY = 0.7
"""Fraction of the ring bandwidth that grouped broadcasts/reduces reach. HAP profiles the
"group call" collectives separately because n concurrent broadcasts pipeline worse than one ring;
the default makes grouped pay once padding wastes more than 30% of a padded collective."""

_BYTES_PER_GIB = 2**30
_BYTES_PER_GBIT = 1e9 / 8


def _positive(values: Sequence[float], what: str) -> tuple[float, ...]:
    out = tuple(float(v) for v in values)
    for i, v in enumerate(out):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"device {i}: {what} must be a finite number > 0, got {v}")
    return out


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """Per-device compute speed, memory and link bandwidth, in rank order.

    Collective times use the alpha-beta model: ``latency_s`` per ring step plus bytes over the
    bottleneck bandwidth of the participating links (one link per device).
    """

    speeds: tuple[float, ...]
    """FLOP/s each device sustains on the model's matmuls."""

    memory_bytes: tuple[float, ...]
    """Bytes each device may use for weights, gradients, optimizer states and activations."""

    bandwidths: tuple[float, ...]
    """Bytes/s of each device's link."""

    latency_s: float = DEFAULT_LATENCY_S
    """Seconds per collective step (message hop)."""

    grouped_efficiency: float = DEFAULT_GROUPED_EFFICIENCY
    """Bandwidth fraction grouped broadcast/reduce collectives reach, in (0, 1]."""

    layer_overhead_flops: float = 0.0
    """Work every device does per layer per step whatever its share (framework and per-op
    launch overhead), in FLOP at the device's own rate: a constant term of every layer."""

    def __post_init__(self) -> None:
        n = len(self.speeds)
        if n == 0:
            raise ValueError("a cluster needs at least one device")
        if len(self.memory_bytes) != n or len(self.bandwidths) != n:
            raise ValueError(
                f"speeds, memory_bytes and bandwidths must have one entry per device, got "
                f"{n}, {len(self.memory_bytes)} and {len(self.bandwidths)}"
            )
        object.__setattr__(self, "speeds", _positive(self.speeds, "speed"))
        object.__setattr__(self, "memory_bytes", _positive(self.memory_bytes, "memory"))
        object.__setattr__(self, "bandwidths", _positive(self.bandwidths, "bandwidth"))
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"latency_s must be finite and >= 0, got {self.latency_s}")
        if not 0 < self.grouped_efficiency <= 1:
            raise ValueError(f"grouped_efficiency must be in (0, 1], got {self.grouped_efficiency}")
        if not (self.layer_overhead_flops >= 0 and math.isfinite(self.layer_overhead_flops)):
            raise ValueError(f"layer_overhead_flops must be >= 0, got {self.layer_overhead_flops}")

    @property
    def num_devices(self) -> int:
        """Number of devices (ranks)."""
        return len(self.speeds)

    @classmethod
    def from_relative(
        cls,
        speeds: Sequence[float],
        *,
        memory_gib: float | Sequence[float] = 80.0,
        bandwidth_gbps: float | Sequence[float] = 100.0,
        reference_flops: float = REFERENCE_FLOPS,
        latency_s: float = DEFAULT_LATENCY_S,
        grouped_efficiency: float = DEFAULT_GROUPED_EFFICIENCY,
        layer_overhead_s: float = 0.0,
    ) -> ClusterSpec:
        """A cluster from relative speeds (1.0 = ``reference_flops``), GiB and Gbit/s.

        ``layer_overhead_s`` is the per-layer fixed time of a speed-1.0 device.
        """
        n = len(speeds)
        memory = [memory_gib] * n if isinstance(memory_gib, int | float) else list(memory_gib)
        bandwidth = (
            [bandwidth_gbps] * n
            if isinstance(bandwidth_gbps, int | float)
            else list(bandwidth_gbps)
        )
        _positive(speeds, "speed")  # name the device before scaling hides the value
        return cls(
            speeds=tuple(s * reference_flops for s in speeds),
            memory_bytes=tuple(m * _BYTES_PER_GIB for m in memory),
            bandwidths=tuple(b * _BYTES_PER_GBIT for b in bandwidth),
            latency_s=latency_s,
            grouped_efficiency=grouped_efficiency,
            layer_overhead_flops=layer_overhead_s * reference_flops,
        )

    @classmethod
    def from_config(
        cls,
        cluster: Any,
        world_size: int,
        *,
        reference_flops: float = REFERENCE_FLOPS,
        latency_s: float = DEFAULT_LATENCY_S,
        grouped_efficiency: float = DEFAULT_GROUPED_EFFICIENCY,
        layer_overhead_s: float = 0.0,
    ) -> ClusterSpec:
        """From a ``config.schema.ClusterConfig``; no devices listed means identical defaults."""
        from colossal_hetero.config.schema import DeviceSpec  # pure dataclasses, no torch

        devices = list(cluster.devices) or [DeviceSpec()] * world_size
        if len(devices) != world_size:
            raise ValueError(
                f"cluster.devices lists {len(devices)} devices but the world size is {world_size}"
            )
        return cls.from_relative(
            [d.speed for d in devices],
            memory_gib=[d.memory_gib for d in devices],
            bandwidth_gbps=[d.bandwidth_gbps for d in devices],
            reference_flops=reference_flops,
            latency_s=latency_s,
            grouped_efficiency=grouped_efficiency,
            layer_overhead_s=layer_overhead_s,
        )


class LayerKind(str, Enum):
    """What a layer computes; decides which strategies apply and what they mean."""

    EMBEDDING = "embedding"
    ATTENTION_QKV = "attention_qkv"
    ATTENTION_CORE = "attention_core"
    """Scores, softmax and context: head-local, no weights."""
    ATTENTION_OUT = "attention_out"
    MLP_UP = "mlp_up"
    MLP_DOWN = "mlp_down"
    LINEAR = "linear"
    NORM = "norm"
    LM_HEAD = "lm_head"
    LOSS = "loss"


class Strategy(str, Enum):
    """How a layer is split over the devices of one tensor-parallel group."""

    COLUMN = "column"
    """Output features split (attention core: heads split; loss: vocabulary split)."""
    ROW = "row"
    """Input features split; the output holds partial sums (embedding: vocabulary split)."""
    REPLICATE = "replicate"
    """Every device computes the whole layer."""
    DATA = "data"
    """Samples split with per-device batch shares; weights replicated, gradients synced."""


WEIGHTED_LINEAR_KINDS = frozenset(
    {
        LayerKind.ATTENTION_QKV,
        LayerKind.ATTENTION_OUT,
        LayerKind.MLP_UP,
        LayerKind.MLP_DOWN,
        LayerKind.LINEAR,
        LayerKind.LM_HEAD,
    }
)


@dataclass(frozen=True, slots=True)
class ShardDim:
    """A dimension that tensor parallelism splits into per-device widths.

    ``size`` is in width units: for a fused QKV projection it is the query width (heads *
    head_dim) and the key/value columns follow in proportion. Every width is a multiple of
    ``granularity`` (whole heads, or an alignment such as 8 or 64).
    """

    size: int
    granularity: int = 1
    aligned: bool = True
    """Whether the planner's ``alignment`` option also applies (False for head dims)."""
    min_units: int = 0
    """Granules every rank must hold: 0 where a rank may hold none (GPT-2 and Llama heads,
    whose policies run a rank with no heads, MLP and vocabulary widths), 1 where a stock layer
    cannot run empty (BERT and ViT attention: a rank holds at least one key/value group)."""

    def __post_init__(self) -> None:
        if self.size < 1 or self.granularity < 1 or self.min_units < 0:
            raise ValueError(f"shard dim needs size, granularity >= 1, min_units >= 0, got {self}")


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer: ``y[tokens, out] = f(x[tokens, in])`` per sample, and how it may be split."""

    name: str
    kind: LayerKind
    tokens: int
    """Tokens per sample this layer processes (sequence length; 1 for a classifier head)."""
    in_features: int
    out_features: int
    flops_per_token: float
    """Forward FLOPs per token of the whole (unsplit) layer; backward counts twice this."""
    weight_params: int = 0
    """Parameters split by column (along out) or row (along in) parallelism."""
    bias_params: int = 0
    """Parameters along the output: split by column parallelism, replicated by row."""
    replicated_params: int = 0
    """Parameters never split (norm weights, position embeddings)."""
    in_shard: ShardDim | None = None
    """How the input features split (row strategy; heads for attention core and out)."""
    out_shard: ShardDim | None = None
    """How the output features split (column strategy)."""
    num_heads: int = 0
    """Attention heads that must stay whole (key/value heads under GQA); 0 for others."""
    head_dim: int = 0
    """Features per attention head, for attention layers (converts widths to head counts)."""
    opens_residual: bool = False
    """The layer's input is also the skip branch of a residual connection."""
    closes_residual: bool = False
    """The layer's output is added to the open residual branch."""
    saves_input: bool = True
    """Backward needs the input activation (counted in activation memory)."""
    saves_output: bool = False
    """Backward also needs the output (activation function input, attention output)."""
    tied: bool = False
    """``weight_params`` belong to another layer (tied LM head): no memory or gradient sync."""
    default: Strategy = Strategy.REPLICATE
    """The strategy stock Colossal-AI shardformer policies use for this layer."""
    modules: tuple[str, ...] = ()
    """Hugging Face module names the layer covers (fused QKV lists q, k and v)."""

    @property
    def signature(self) -> tuple[Any, ...]:
        """Everything but the names: layers with equal signatures cost the same."""
        return tuple(getattr(self, f) for f in self.__slots__ if f not in ("name", "modules"))


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model as a chain of layers, plus the batch it trains on per optimizer step."""

    name: str
    layers: tuple[LayerSpec, ...]
    batch_size: int
    """Samples per optimizer step, summed over all data-parallel ranks."""
    seq_len: int
    dtype_bytes: int = 4
    """Bytes per element of weights, gradients and activations (fp32: 4; fp16, bf16: 2)."""
    optimizer_bytes_per_param: int = 8
    """Optimizer state bytes per parameter: Adam keeps two fp32 moments."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Free-form facts about the source config (architecture, head counts) for reports."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ValueError("a model needs at least one layer")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.dtype_bytes not in (1, 2, 4, 8):
            raise ValueError(f"dtype_bytes must be 1, 2, 4 or 8, got {self.dtype_bytes}")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError("layer names must be unique")
        is_open = False
        for layer in self.layers:
            if layer.opens_residual:
                if is_open:
                    raise ValueError(f"layer {layer.name}: opens a residual that is already open")
                is_open = True
            if layer.closes_residual:
                if not is_open:
                    raise ValueError(f"layer {layer.name}: closes a residual that is not open")
                is_open = False
        if is_open:
            raise ValueError(f"layer {self.layers[-1].name}: model ends with an open residual")

    @property
    def state_bytes_per_param(self) -> int:
        """Weight + gradient (dtype each) + optimizer states + fp32 master copy below fp32."""
        master = 4 if self.dtype_bytes < 4 else 0
        return 2 * self.dtype_bytes + self.optimizer_bytes_per_param + master

    @property
    def num_params(self) -> int:
        """Parameters of the model (tied weights counted once)."""
        return sum(
            (0 if la.tied else la.weight_params) + la.bias_params + la.replicated_params
            for la in self.layers
        )


@dataclass(frozen=True, slots=True)
class Mesh:
    """Devices as ``dp_size`` data-parallel groups of ``tp_size`` tensor-parallel ranks.

    Device ``d`` is rank ``d % tp_size`` of group ``d // tp_size``: tensor parallelism is the
    innermost axis, as in Colossal-AI's HybridParallelPlugin mesh (pp, dp, tp) with pp = 1.
    """

    tp_size: int
    dp_size: int

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.dp_size < 1:
            raise ValueError(f"tp_size and dp_size must be >= 1, got {self}")

    @classmethod
    def for_devices(cls, num_devices: int, tp_size: int) -> Mesh:
        """The mesh of ``num_devices`` with tensor-parallel groups of ``tp_size``."""
        if tp_size < 1 or num_devices % tp_size != 0:
            raise ValueError(
                f"tp_size {tp_size} must be >= 1 and divide the number of devices {num_devices}"
            )
        return cls(tp_size=tp_size, dp_size=num_devices // tp_size)

    @property
    def num_devices(self) -> int:
        """tp_size * dp_size."""
        return self.tp_size * self.dp_size

    def group(self, device: int) -> int:
        """Data-parallel group of ``device``."""
        return device // self.tp_size

    def rank(self, device: int) -> int:
        """Tensor-parallel rank of ``device`` within its group."""
        return device % self.tp_size


ZERO_HEAD_MODEL_TYPES = frozenset({"gpt2", "llama"})
"""Model types whose policies run a tensor-parallel rank with no attention heads
(``policies.zero_heads``); the others keep at least one key/value group per rank."""


def min_head_groups(model_type: str | None) -> int:
    """The fewest key/value head groups a rank may hold for ``model_type`` (0 or 1)."""
    return 0 if model_type in ZERO_HEAD_MODEL_TYPES else 1
