"""Cost model: per-device compute time, collective time and memory of one layer under a strategy.

The step is modelled as bulk synchronous, like HAP: a layer costs the slowest device's compute
plus the time of every collective it triggers, forward and backward, with no overlap. Each cost
is a row vector (one row per device, two for all-to-all) whose maximum is the time; rows are
affine in the shares (:mod:`.affine`), so the LP sees exactly these formulas, constants included.

Collectives (alpha-beta model, ``m`` devices, ``lat`` per step, shard bytes ``s_d``):
  * padded all-gather / reduce-scatter: every step moves the largest shard,
    ``(m-1) * max_d s_d / bw_min + (m-1) * lat``;
  * grouped broadcasts / reduces: device ``j`` receives every other true-size shard,
    ``max_j (sum_d s_d - s_j) / (eff * bw_j) + (m-1) * lat``;
  * ring all-reduce of ``S`` bytes: ``2 (m-1)/m * S / bw_min + 2 (m-1) * lat`` (gradient
    all-reduces are bucketed: latency scaled by ``S / GRAD_BUCKET_BYTES``);
  * uneven all-to-all: ``(m-1)/m * max(send_d, recv_d) / bw_d + (m-1) * lat`` (exact when even).

Layouts of an activation between layers (gradient conventions follow Megatron, so each
transition's backward is known): R replicated (its gradient is kept replicated), B samples split
by in-group batch shares, F features split by tensor-parallel widths, P partial sums.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

from colossal_hetero.planner.affine import Affine, RowVec, concat
from colossal_hetero.planner.spec import (
    WEIGHTED_LINEAR_KINDS,
    ClusterSpec,
    LayerKind,
    LayerSpec,
    Mesh,
    ModelSpec,
    ShardDim,
    Strategy,
)

BACKWARD_FLOPS_FACTOR = 2.0
"""Backward FLOPs per forward FLOP: a matmul's backward computes dX and dW."""

GRAD_BUCKET_BYTES = 25 * 2**20
"""Gradient all-reduces are bucketed (DDP's and Colossal-AI's default 25 MiB), so a layer's
gradient sync pays latency in proportion to its bytes, not once per layer."""

_LOSS_REDUCE_FLOATS = 3
"""fp32 values per token all-reduced by vocab-parallel cross entropy (max, sum-exp, target)."""


class Layout(str, Enum):
    """How an activation is laid out over the devices of a tensor-parallel group."""

    INPUT = "input"
    """Model input (token ids, pixels): each device loads what it needs, R or B, for free."""
    R = "R"
    B = "B"
    F = "F"
    P = "P"
    END = "end"
    """After the loss: nothing flows on."""


class Collective(str, Enum):
    """How an uneven all-gather or reduce-scatter runs."""

    PADDED = "padded"
    """One NCCL collective on shards padded to the largest."""
    GROUPED = "grouped"
    """One broadcast (or reduce) per rank, of its true size, in one group call."""


class GradSync(str, Enum):
    """How replicated weights get their data-parallel gradient."""

    ALLREDUCE = "allreduce"
    SFB = "sfb"
    """Sufficient factor broadcasting: gather each device's inputs and output gradients and
    rebuild dW = sum dy^T x (and the bias gradient, sum dy) locally (Xie et al., UAI'16); pays
    when tokens * (in + out) is small next to in * out."""


@dataclass(frozen=True, slots=True)
class Placement:
    """A layout, and for F the dimension whose widths split the features."""

    layout: Layout
    shard: ShardDim | None = None


@dataclass(frozen=True, slots=True)
class Tensor:
    """An activation per sample: ``tokens x features`` elements."""

    tokens: int
    features: int


@dataclass(frozen=True, slots=True)
class Term:
    """One synchronising part of a layer's time: its value is the maximum of its rows."""

    label: str
    rows: RowVec
    compute: bool = False


@dataclass(frozen=True, slots=True)
class StrategyIO:
    """What a strategy consumes and produces, and which dimension splits its work."""

    source: Placement
    result: Placement
    split: ShardDim | None
    """Work and weights split by tensor-parallel widths of this dim (None: not split)."""
    batched: bool = False
    """Work split by in-group batch shares."""


@dataclass(frozen=True, slots=True)
class Shares:
    """Continuous shares: tensor-parallel ratios, in-group batch ratios, group batch ratios."""

    tp: tuple[float, ...]
    """Fraction of every split dimension per tensor-parallel rank (sums to 1)."""
    batch: tuple[float, ...]
    """Fraction of its group's samples per tensor-parallel rank under the data strategy."""
    groups: tuple[float, ...]
    """Fraction of the global batch per data-parallel group (sums to 1)."""


@dataclass(frozen=True, slots=True)
class Loads:
    """Per-device quantities that shares decide: numbers, or affine rows of free shares."""

    group_samples: RowVec
    """Samples of the device's group (what R, F and P layouts process per device)."""
    batch_samples: RowVec
    """Samples the device processes under the B layout."""
    tp_frac: RowVec | Mapping[ShardDim, RowVec]
    """Fraction of a split dim per device: one vector for all dims, or one per dim (widths)."""

    def frac(self, shard: ShardDim) -> RowVec:
        """The device's fraction of ``shard``."""
        if isinstance(self.tp_frac, Mapping):
            return self.tp_frac[shard]
        return self.tp_frac

    @classmethod
    def continuous(cls, mesh: Mesh, batch_size: int, shares: Shares) -> Loads:
        """Numbers from continuous shares (what A* searches with)."""
        g, k = _coords(mesh)
        samples = np.asarray(shares.groups)[g] * batch_size
        return cls(samples, samples * np.asarray(shares.batch)[k], np.asarray(shares.tp)[k])

    @classmethod
    def free_tp(cls, mesh: Mesh, batch_size: int, shares: Shares) -> Loads:
        """Affine in ``x = [tp ratios, batch ratios]`` (2 * tp_size variables), groups fixed."""
        g, k = _coords(mesh)
        samples = np.asarray(shares.groups)[g] * batch_size
        nv = 2 * mesh.tp_size
        return cls(
            samples,
            Affine.select(nv, mesh.tp_size + k, scale=samples),
            Affine.select(nv, k),
        )

    @classmethod
    def free_groups(cls, mesh: Mesh, batch_size: int, shares: Shares) -> Loads:
        """Affine in ``x = group ratios`` (dp_size variables), tensor-parallel shares fixed."""
        g, k = _coords(mesh)
        batch = np.asarray(shares.batch)[k]
        return cls(
            Affine.select(mesh.dp_size, g, scale=float(batch_size)),
            Affine.select(mesh.dp_size, g, scale=batch_size * batch),
            np.asarray(shares.tp)[k],
        )

    @classmethod
    def rounded(
        cls,
        mesh: Mesh,
        widths: Mapping[ShardDim, Sequence[int]],
        group_samples: Sequence[int],
        batch_split: Sequence[Sequence[int]],
    ) -> Loads:
        """Numbers from integer widths per split dim and integer samples (the final plan)."""
        g, k = _coords(mesh)
        fracs = {dim: np.asarray(w, dtype=float)[k] / dim.size for dim, w in widths.items()}
        split = np.asarray(batch_split, dtype=float)
        return cls(np.asarray(group_samples, dtype=float)[g], split[g, k], fracs)


def _coords(mesh: Mesh) -> tuple[np.ndarray, np.ndarray]:
    d = np.arange(mesh.num_devices)
    return d // mesh.tp_size, d % mesh.tp_size


@dataclass(frozen=True, slots=True)
class _Scope:
    """A family of concurrent collectives: device d's peers, and their slowest link."""

    size: int
    peers: np.ndarray
    """0/1 matrix: peers[i, j] when i and j are in the same collective."""
    bottleneck: np.ndarray
    """Per device: the smallest bandwidth among its peers."""

    @classmethod
    def of(cls, labels: np.ndarray, bandwidths: np.ndarray) -> _Scope:
        peers = (labels[:, None] == labels[None, :]).astype(float)
        masked = np.where(peers > 0, bandwidths[None, :], np.inf)
        return cls(int(peers[0].sum()), peers, masked.min(axis=1))


def _is_zero(rows: RowVec) -> bool:
    return not isinstance(rows, Affine) and not np.any(rows)


class CostModel:
    """Times and memory of layers of ``model`` on ``cluster`` arranged as ``mesh``.

    Scopes: "tp" (a device's tensor-parallel group), "dp" (same rank across data-parallel
    groups: the gradient ring of a sharded weight) and "world" (all devices).
    """

    def __init__(self, cluster: ClusterSpec, model: ModelSpec, mesh: Mesh) -> None:
        if cluster.num_devices != mesh.num_devices:
            raise ValueError(f"{cluster.num_devices} devices do not fill a {mesh} mesh")
        self.cluster, self.model, self.mesh = cluster, model, mesh
        self.speeds = np.asarray(cluster.speeds)
        self.layer_overhead = cluster.layer_overhead_flops
        self.bandwidths = np.asarray(cluster.bandwidths)
        self.dtype = model.dtype_bytes
        g, k = _coords(mesh)
        self.scopes = {
            "tp": _Scope.of(g, self.bandwidths),
            "dp": _Scope.of(k, self.bandwidths),
            "world": _Scope.of(np.zeros_like(g), self.bandwidths),
        }

    # -- strategies -------------------------------------------------------------------------

    @staticmethod
    def strategies(layer: LayerSpec) -> tuple[Strategy, ...]:
        """Strategies that apply to ``layer``, in a fixed order."""
        if layer.kind is LayerKind.NORM:
            return (Strategy.REPLICATE, Strategy.DATA)
        out: list[Strategy] = []
        splits_output = layer.kind in (LayerKind.ATTENTION_CORE, LayerKind.LOSS)
        if (layer.in_shard if splits_output else layer.out_shard) is not None:
            out.append(Strategy.COLUMN)
        if not splits_output and layer.in_shard is not None:
            out.append(Strategy.ROW)
        return (*out, Strategy.REPLICATE, Strategy.DATA)

    @staticmethod
    def io(layer: LayerSpec, strategy: Strategy) -> StrategyIO:
        """Input and output placements of ``layer`` under ``strategy``."""
        end = layer.kind is LayerKind.LOSS
        whole = Placement(Layout.END) if end else None
        if strategy is Strategy.REPLICATE:
            return StrategyIO(Placement(Layout.R), whole or Placement(Layout.R), None)
        if strategy is Strategy.DATA:
            return StrategyIO(Placement(Layout.B), whole or Placement(Layout.B), None, True)
        if layer.kind in (LayerKind.ATTENTION_CORE, LayerKind.LOSS):
            assert strategy is Strategy.COLUMN and layer.in_shard is not None
            result = whole or Placement(Layout.F, layer.out_shard)
            return StrategyIO(Placement(Layout.F, layer.in_shard), result, layer.in_shard)
        if strategy is Strategy.COLUMN:
            assert layer.out_shard is not None
            return StrategyIO(
                Placement(Layout.R), Placement(Layout.F, layer.out_shard), layer.out_shard
            )
        assert strategy is Strategy.ROW and layer.in_shard is not None
        # The vocab-parallel embedding reads replicated ids and splits the table's rows.
        source = (
            Placement(Layout.R)
            if layer.kind is LayerKind.EMBEDDING
            else Placement(Layout.F, layer.in_shard)
        )
        return StrategyIO(source, Placement(Layout.P), layer.in_shard)

    def sfb_applies(self, layer: LayerSpec, strategy: Strategy) -> bool:
        """Whether sufficient factor broadcasting can replace the gradient all-reduce."""
        scope = self._grad_scope(strategy)
        return (
            layer.kind in WEIGHTED_LINEAR_KINDS
            and not layer.tied
            and layer.weight_params > 0
            and strategy in (Strategy.REPLICATE, Strategy.DATA)
            and self.scopes[scope].size > 1
        )

    # -- collectives ------------------------------------------------------------------------

    def gather(self, shard_bytes: RowVec, scope: str, method: Collective) -> RowVec:
        """All-gather (or reduce-scatter) of uneven shards of ``shard_bytes`` per device."""
        sc = self.scopes[scope]
        m = sc.size
        lat = (m - 1) * self.cluster.latency_s
        if method is Collective.PADDED:
            return shard_bytes * ((m - 1) / sc.bottleneck) + lat
        received = sc.peers @ shard_bytes - shard_bytes
        return received / (self.cluster.grouped_efficiency * self.bandwidths) + lat

    def allreduce(self, full_bytes: RowVec, scope: str, *, bucketed: bool = False) -> RowVec:
        """Ring all-reduce of ``full_bytes`` per device (``bucketed``: one of many gradients
        fused into buckets, paying latency per bucket-sized share)."""
        sc = self.scopes[scope]
        m = sc.size
        latency = 2 * (m - 1) * self.cluster.latency_s
        if bucketed:
            return full_bytes * (2 * (m - 1) / m / sc.bottleneck + latency / GRAD_BUCKET_BYTES)
        return full_bytes * (2 * (m - 1) / m / sc.bottleneck) + latency

    def alltoall(self, send: RowVec, recv: RowVec, scope: str) -> RowVec:
        """Uneven all-to-all from ``send`` bytes held to ``recv`` bytes wanted, per device."""
        m = self.scopes[scope].size
        scale = (m - 1) / m / self.bandwidths
        lat = (m - 1) * self.cluster.latency_s
        return concat([send * scale + lat, recv * scale + lat])

    # -- activations ------------------------------------------------------------------------

    def tensor_bytes(self, tensor: Tensor, place: Placement, loads: Loads) -> RowVec:
        """Bytes of ``tensor`` each device holds under ``place``."""
        per_sample = float(tensor.tokens * tensor.features * self.dtype)
        if place.layout in (Layout.R, Layout.P):
            return loads.group_samples * per_sample
        if place.layout is Layout.B:
            return loads.batch_samples * per_sample
        if place.layout is Layout.F:
            assert place.shard is not None
            return loads.group_samples * per_sample * loads.frac(place.shard)
        return np.zeros(self.mesh.num_devices)

    def transition(
        self, tensor: Tensor, src: Placement, dst: Placement, method: Collective, loads: Loads
    ) -> tuple[list[Term], bool] | None:
        """Terms that re-lay ``tensor`` from ``src`` to ``dst`` (forward and backward).

        Returns ``(terms, uses_method)``, where ``uses_method`` says whether an uneven gather
        or scatter (whose cost depends on ``method``) is among them; None if impossible.
        """
        if src == dst:
            return [], False
        if src.layout is Layout.INPUT:
            return ([], False) if dst.layout in (Layout.R, Layout.B) else None
        if dst.layout not in (Layout.R, Layout.B, Layout.F) or src.layout is Layout.END:
            return None
        if self.mesh.tp_size == 1:
            return [], False  # one device per group: every layout is the whole tensor

        def size(p: Placement) -> RowVec:
            return self.tensor_bytes(tensor, p, loads)

        def gather(label: str, p: Placement) -> Term:
            return Term(label, self.gather(size(p), "tp", method))

        if dst.layout is Layout.R:
            if src.layout is Layout.P:  # backward: the replicated gradient is already whole
                return [Term("all-reduce", self.allreduce(size(src), "tp"))], False
            return [gather("all-gather", src)], True  # backward: local slice
        if src.layout is Layout.R:  # forward: local slice; backward: gather the gradient
            return [gather("all-gather (bwd)", dst)], True
        if src.layout is Layout.P:
            return [gather("reduce-scatter", dst), gather("all-gather (bwd)", dst)], True
        # B <-> F, or F split differently: all-to-all both ways.
        return [
            Term("all-to-all", self.alltoall(size(src), size(dst), "tp")),
            Term("all-to-all (bwd)", self.alltoall(size(dst), size(src), "tp")),
        ], False

    # -- a layer under a strategy -----------------------------------------------------------

    def params(self, layer: LayerSpec, strategy: Strategy, loads: Loads) -> RowVec:
        """Parameters each device holds (tied weights count on their owner)."""
        io = self.io(layer, strategy)
        weight = 0 if layer.tied else layer.weight_params
        full = float(weight + layer.bias_params + layer.replicated_params)
        if io.split is None:
            return np.full(self.mesh.num_devices, full)
        frac = loads.frac(io.split)
        if strategy is Strategy.COLUMN:
            return frac * float(weight + layer.bias_params) + float(layer.replicated_params)
        return frac * float(weight) + float(layer.bias_params + layer.replicated_params)

    def _samples(self, io: StrategyIO, loads: Loads) -> RowVec:
        if io.batched:
            return loads.batch_samples
        if io.split is not None:
            return loads.group_samples * loads.frac(io.split)
        return loads.group_samples

    def _grad_scope(self, strategy: Strategy) -> str:
        return "world" if strategy is Strategy.DATA else "dp"

    def layer_terms(
        self,
        layer: LayerSpec,
        strategy: Strategy,
        grad_sync: GradSync,
        method: Collective,
        loads: Loads,
    ) -> tuple[list[Term], bool]:
        """Compute, in-layer communication and gradient sync of ``layer`` under ``strategy``.

        Returns ``(terms, uses_method)`` as :meth:`transition` does.
        """
        io = self.io(layer, strategy)
        flops = layer.flops_per_token * layer.tokens * (1.0 + BACKWARD_FLOPS_FACTOR)
        compute = self._samples(io, loads) * flops / self.speeds
        if self.layer_overhead:  # fixed per-layer work: a constant, heavier on slow devices
            compute = compute + self.layer_overhead / self.speeds
        terms: list[Term] = []
        uses_method = False
        tp = self.mesh.tp_size > 1
        if strategy is Strategy.COLUMN and tp:
            if layer.kind in WEIGHTED_LINEAR_KINDS:  # Megatron's f: dX partial sums
                x = Tensor(layer.tokens, layer.in_features)
                x_bytes = self.tensor_bytes(x, Placement(Layout.R), loads)
                terms.append(Term("dX all-reduce", self.allreduce(x_bytes, "tp")))
            elif layer.kind is LayerKind.LOSS:
                stats = loads.group_samples * float(layer.tokens * _LOSS_REDUCE_FLOATS * 4)
                terms.append(Term("loss all-reduce", self.allreduce(stats, "tp")))
        scope = self._grad_scope(strategy)
        param_bytes = self.params(layer, strategy, loads) * float(self.dtype)
        if grad_sync is GradSync.SFB:
            assert self.sfb_applies(layer, strategy)
            peers = self.scopes[scope].peers
            own_tokens = self._samples(io, loads) * float(layer.tokens)
            # Each module of the layer gathers its own input (q, k and v each gather x) and
            # its output gradient (colossal_hetero.comm.sfb).
            features = max(1, len(layer.modules)) * layer.in_features + layer.out_features
            factors = own_tokens * float(features * self.dtype)
            terms.append(Term("factor all-gather", self.gather(factors, scope, method)))
            uses_method = True
            # Each device rebuilds dW (and the bias gradient) from every peer's factors, its own
            # included so that every replica sums in the same order: 2 FLOPs per weight per
            # token, on top of the local dW autograd computes anyway.
            group_tokens = peers @ own_tokens
            compute = compute + group_tokens * (2.0 * layer.weight_params) / self.speeds
            param_bytes = np.full(self.mesh.num_devices, float(layer.replicated_params))
            param_bytes = param_bytes * float(self.dtype)
        if self.scopes[scope].size > 1 and not _is_zero(param_bytes):
            grad = self.allreduce(param_bytes, scope, bucketed=True)
            terms.append(Term(f"grad all-reduce ({scope})", grad))
        return [Term("compute", compute, compute=True), *terms], uses_method

    def memory(self, layer: LayerSpec, strategy: Strategy, loads: Loads) -> RowVec:
        """Bytes per device: parameter state (weight, grad, optimizer) and saved activations."""
        io = self.io(layer, strategy)
        mem = self.params(layer, strategy, loads) * float(self.model.state_bytes_per_param)
        if layer.saves_input:
            x = Tensor(layer.tokens, layer.in_features)
            mem = mem + self.tensor_bytes(x, io.source, loads)
        if layer.saves_output:
            y = Tensor(layer.tokens, layer.out_features)
            mem = mem + self.tensor_bytes(y, io.result, loads)
        return mem
