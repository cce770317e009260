"""ZERO-resizing inside SUMMA steps: a straggler's Linear2D GEMMs over a kept subset of K.

The 2D counterpart of ``balance/ops/resize.py`` (the 1D op). A Linear2D y = x W, W [K, N],
runs one summa_ab: rank (i, j) sums over the q blocks of the reduction dimension K (block t
in step t, cut by ``in_sizes``). With a ``Resize2D`` attached for mesh position (i*, j*),
that rank computes only the kept entries P of K in every step:

    y[b_i*, n_j*] = x[b_i*, P] W[P, n_j*] (+ bias)            (smaller GEMMs in each step)
    its share of dx[b_i*, D] and of dW[D, n_j*] = impute_value (0: no contribution)

and everything else is unchanged: every broadcast and reduce (2q per kernel, the same groups
and sizes), the output and gradient shapes, the other ranks' GEMMs. Its shares of dx and dW
are terms of sums reduced over its row and column group, so with impute_value 0 the result
is the exact gradient of the resized layer: dW[D, n_j*] keeps the other batch shares' terms
(unlike 1D, where the straggler owns its whole dW and D gets none), and dx[:, D] keeps the
other output columns' terms. The bias and the other ranks' outputs are exact. Never active in
eval or under no_grad (Linear2D checks), so evaluation uses the whole layer.

Choosing P reuses the 1D pieces (``balance/ops/selection.py``): the fraction from a measured
slowdown (``kept_fraction``), priority by recent weight change with stale scores
(``PriorityTracker`` on each rank's block W[K_i, N_j], summed per mesh column by
``Priority2D.scores``, one gather over the mesh), then ``select_kept``. Every input of those
is identical on every rank, so is P. Freezing: ``freeze_targets_2d`` gives the rows W[D, n_j*]
(on the ranks of column j*) for ``balance.ops.resize.frozen_columns``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from colossal_hetero.balance.inlayer import InLayerPlan
from colossal_hetero.balance.ops.resize import (
    FreezeTargets,
    check_columns,
    complement,
    freeze_on_step,
)
from colossal_hetero.balance.ops.selection import (
    PRIORITY_RULES,
    PriorityTracker,
    kept_fraction,
    select_kept,
)
from colossal_hetero.tp2d.layers import Linear2D, gather_matrix
from colossal_hetero.tp2d.layout import offsets

Position = tuple[int, int]
"""A mesh position (i, j)."""


@dataclass(frozen=True)
class Resize2D:
    """One Linear2D's ZERO-resizing: each straggler position computes its ``kept`` of K only.

    ``kept[(i, j)]``: sorted LongTensor within [0, sum(in_sizes)), the same on every rank.
    ``steps``: what this rank's summa_ab takes, its own kept entries cut into the q reduction
    blocks (local indices per step); None when this rank keeps every entry.
    """

    kept: Mapping[Position, torch.Tensor]
    steps: tuple[torch.Tensor, ...] | None
    impute_value: float = 0.0


def split_steps(kept: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Global indices ``kept`` within [0, sum(sizes)) -> per block t its local indices."""
    out = []
    for start, size in zip(offsets(sizes), sizes, strict=True):
        inside = kept[(kept >= start) & (kept < start + size)]
        out.append(inside - start)
    return tuple(out)


def linear_layers(model: nn.Module) -> dict[str, Linear2D]:
    """Every Linear2D of ``model`` by qualified name (the model itself: name '')."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear2D)}


def _check_position(position: Position, q: int) -> Position:
    i, j = (int(v) for v in position)
    if not (0 <= i < q and 0 <= j < q):
        raise ValueError(
            f"straggler {position} must be a mesh position (i, j) of the {q} x {q} mesh"
        )
    return i, j


def attach_resize_2d(
    model: nn.Module,
    kept: Mapping[Position, Mapping[str, torch.Tensor]],
    *,
    impute_value: float = 0.0,
) -> dict[str, Resize2D]:
    """ZERO-resize Linear2D layers: ``kept[(i, j)][name]``, the entries of K that the rank at
    mesh position (i, j) computes in layer ``name`` (see ``Resize2D``).

    Every rank passes the same arguments. Everything is checked (ValueError, the same on every
    rank, no collective) before any layer changes. Each layer named under some position gets a
    new op (its stragglers: the positions naming it); the others keep theirs.
    """
    layers = linear_layers(model)
    per_layer: dict[str, dict[Position, torch.Tensor]] = {}
    for position, by_name in kept.items():
        unknown = sorted(set(by_name) - set(layers))
        if unknown:
            raise ValueError(f"kept names no Linear2D of the model: {unknown}")
        for name, indices in by_name.items():
            layer = layers[name]
            where = _check_position(position, layer.mesh.q)
            indices = indices.detach().cpu()
            check_columns(indices, sum(layer.in_sizes), f"kept[{where}][{name!r}]")
            per_layer.setdefault(name, {})[where] = indices
    ops = {}
    for name, by_position in per_layer.items():
        layer = layers[name]
        mine = by_position.get((layer.mesh.i, layer.mesh.j))
        steps = None
        if mine is not None and mine.numel() < sum(layer.in_sizes):
            device = layer.weight.device
            steps = tuple(s.to(device) for s in split_steps(mine, layer.in_sizes))
        ops[name] = Resize2D(by_position, steps, float(impute_value))
    for name, op in ops.items():
        layers[name].resize = op
    return ops


def detach_resize_2d(model: nn.Module) -> None:
    """Every Linear2D of ``model`` back to the whole GEMM."""
    for layer in linear_layers(model).values():
        layer.resize = None


def _dropped_rows(layer: Linear2D) -> torch.Tensor:
    """Rows of this rank's weight block W[K_i, N_j] that a straggler of its mesh column drops
    (the union over them; empty when none)."""
    op, (i, j) = layer.resize, (layer.mesh.i, layer.mesh.j)
    rows = torch.zeros(layer.in_sizes[i], dtype=torch.bool)
    for position, kept in op.kept.items() if op is not None else ():
        if position[1] == j:
            rows[complement(split_steps(kept, layer.in_sizes)[i], layer.in_sizes[i])] = True
    return rows.nonzero().flatten()


def freeze_targets_2d(
    model: nn.Module, masters: Mapping[Any, nn.Parameter] | None = None
) -> list[tuple[nn.Parameter, int, torch.Tensor]]:
    """(weight, 0, dropped rows) of each resized Linear2D block on this rank, for
    ``balance.ops.resize.frozen_columns``: a straggler's dropped entries W[D, n_j*] keep
    their value and optimizer state on every rank of its mesh column (they still get the other
    batch shares' gradient terms; freezing drops those too). ``masters``: working weight ->
    the optimizer's fp32 master (mixed precision), which is then the one frozen."""
    targets = []
    for layer in linear_layers(model).values():
        rows = _dropped_rows(layer)
        if rows.numel():
            param = (masters or {}).get(layer.weight, layer.weight)
            targets.append((param, 0, rows.to(param.device)))
    return targets


class Priority2D:
    """Priority scores (the A.4 rule) of every Linear2D's K entries, per mesh column.

    Each rank tracks its own block W[K_i, N_j] with a ``PriorityTracker`` (rows: dim 0).
    ``refresh`` (local) at each period boundary: the rows its column's stragglers computed
    last period get their change, the dropped rows keep their stale score. ``scores``
    (collective over the mesh: 2q broadcasts for all layers together) returns per layer
    [K, q]: column j scores the entries by their change in W[:, n_j], the weights that mesh
    column j's outputs use. With ``rule="magnitude"`` (``PriorityTracker``) an entry's score
    is instead the norm of its row of W[:, n_j], fresh at every refresh (nothing stale).
    """

    def __init__(self, model: nn.Module, rule: str = "change") -> None:
        self.trackers = {
            name: PriorityTracker(layer.weight, 0, rule=rule)
            for name, layer in linear_layers(model).items()
        }

    def refresh(self, model: nn.Module) -> None:
        for name, layer in linear_layers(model).items():
            rows = layer.in_sizes[layer.mesh.i]
            computed = complement(_dropped_rows(layer), rows)
            self.trackers[name].refresh(layer.weight, computed)

    def scores(self, model: nn.Module) -> dict[str, torch.Tensor]:
        layers = linear_layers(model)
        if not layers:
            return {}
        mesh = next(iter(layers.values())).mesh
        rows = [sum(layer.in_sizes[i] for layer in layers.values()) for i in range(mesh.q)]
        mine = torch.cat([self.trackers[name].scores for name in layers])
        table = gather_matrix(mine.unsqueeze(1), mesh, rows, [1] * mesh.q)  # [sum K, q]
        out, at = {}, [0] * mesh.q  # each mesh row's blocks sit in layer order
        starts = offsets(rows)
        for name, layer in layers.items():
            parts = []
            for i in range(mesh.q):
                size = layer.in_sizes[i]
                parts.append(table[starts[i] + at[i] : starts[i] + at[i] + size])
                at[i] += size
            out[name] = torch.cat(parts)
        return out


def kept_for_fraction(
    model: nn.Module,
    straggler: Position,
    fraction: float,
    scores: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Every Linear2D's ``kept_count(K, fraction)`` entries for the straggler at mesh position
    ``straggler`` (pure, local): the highest-scored ones of its mesh column in ``scores``
    (``Priority2D.scores``), or the first ones (ties by index) without scores."""
    out = {}
    for name, layer in linear_layers(model).items():
        _, j = _check_position(straggler, layer.mesh.q)
        total = sum(layer.in_sizes)
        column = scores[name][:, j] if scores is not None else torch.ones(total)
        out[name] = select_kept(column, fraction)
    return out


def kept_for_slowdown(
    model: nn.Module,
    straggler: Position,
    slowdown: float,
    scores: Mapping[str, torch.Tensor] | None = None,
    *,
    min_fraction: float = 0.5,
    gemm_share: float = 1.0,
) -> dict[str, torch.Tensor]:
    """``kept_for_fraction`` at ``kept_fraction(slowdown, min_fraction=, gemm_share=)``: a
    straggler ``slowdown`` times slower than the fastest rank (measured)."""
    fraction = kept_fraction(slowdown, min_fraction=min_fraction, gemm_share=gemm_share)
    return kept_for_fraction(model, straggler, fraction, scores)


class LayerOps2D:
    """The balancer's in-layer actuator for a 2D model: ``balance.actuator.LayerOps``'s
    interface (``plan``, ``apply``, ``clear``, ``refresh``, ``freeze_targets``,
    ``install_freeze``, ``bytes_sent``), ZERO-resizing only.

    An ``Offload``'s ``rank`` is a tensor-parallel position (the index of a global rank in
    the TP group, ascending, as ``dist.get_rank(tp_group)`` numbers them); it maps to the mesh
    position that rank sits at. ``apply`` and ``refresh`` are collective over the mesh
    (``Priority2D.scores``): every rank calls them at the same step, as the controller does
    (right after its agreement). Migration plans: ValueError (2D has no migration op).
    """

    def __init__(
        self, model: nn.Module, *, impute_value: float = 0.0, priority: str = "change"
    ) -> None:
        if priority not in PRIORITY_RULES:
            raise ValueError(f"priority must be one of {PRIORITY_RULES}, got {priority!r}")
        self.model, self.impute_value, self.rule = model, impute_value, priority
        self.plan = InLayerPlan()
        self.priority: Priority2D | None = None
        self.bytes_sent = 0  # no migration: nothing is sent

    def position(self, tp_rank: int) -> Position:
        """Mesh position of the ``tp_rank``-th rank (ascending) of the TP group."""
        layers = linear_layers(self.model)
        if not layers:
            raise ValueError("the model has no Linear2D layer to resize")
        layout = next(iter(layers.values())).mesh.layout
        return layout.position(sorted(layout.positions)[tp_rank])

    def clear(self) -> None:
        """Every layer whole again; priority scores forgotten."""
        detach_resize_2d(self.model)
        self.plan, self.priority = InLayerPlan(), None

    def apply(self, plan: InLayerPlan) -> None:
        """Attach ``plan`` (the same on every rank): each straggler keeps 1 - dropped of every
        layer's K, chosen by priority (a straggler that stays keeps its scores)."""
        if plan.migrating:
            raise ValueError(
                "balancer.mode: parallel.tp_mode 2d supports in-layer resize only, not migration"
            )
        detach_resize_2d(self.model)
        self.plan = plan
        if plan.empty:
            self.priority = None
            return
        if self.priority is None:
            self.priority = Priority2D(self.model, self.rule)
        self._select(self.priority.scores(self.model))

    def refresh(self) -> None:
        """Priority period boundary: update the scores, re-select (same counts). Collective."""
        if self.plan.empty or self.priority is None:
            return
        self.priority.refresh(self.model)
        self._select(self.priority.scores(self.model))

    def _select(self, scores: Mapping[str, torch.Tensor]) -> None:
        kept = {
            self.position(o.rank): kept_for_fraction(
                self.model, self.position(o.rank), 1 - o.dropped, scores
            )
            for o in self.plan.offloads
            if o.dropped > 0
        }
        attach_resize_2d(self.model, kept, impute_value=self.impute_value)

    def freeze_targets(self, optimizer: Any) -> list[tuple[nn.Parameter, int, torch.Tensor]]:
        """``freeze_targets_2d`` with the optimizer's fp32 masters under mixed precision."""
        return freeze_targets_2d(self.model, getattr(optimizer, "working_to_master_map", None))

    def install_freeze(self, optimizer: Any) -> None:
        """Run the inner optimizer's ``step`` with the dropped rows frozen (as ``LayerOps``)."""

        def targets() -> FreezeTargets:
            return self.freeze_targets(optimizer) if not self.plan.empty else []

        freeze_on_step(optimizer, targets)
