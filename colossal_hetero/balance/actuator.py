"""The in-layer actuator: attaches an agreed :class:`InLayerPlan` to every resizable TP layer.

Called by the balance controller between steps, on every rank, with the same plan (derived
from the agreed detector vector only). Each rank sets, on each of its resizable layers
(``layers.linear.ResizableParallelModule``), the ``local_op`` its position needs:

- a ZERO-resized straggler: ``ZeroResize`` over its kept columns (priority selection on its
  own weight shard: ``PriorityTracker``, refreshed at every agreement on every rank, with
  or without ops, so that scores exist before a rank straggles and survive ``clear``;
  dropped columns keep their stale scores);
- migrating stragglers and their helpers: one ``MultiMigration`` (the migrated slices are the
  same on every rank: contiguous slices of the columns in index order; a migrate+resize
  straggler drops its lowest-priority remaining columns, which only it needs to know);
- everyone else: no op.

Ops live only while a plan is attached; ``clear`` removes them (recovery, a probe, a width
move) and keeps the scores (a tracker whose weight changed shape rebases itself). The
layers skip any op in eval and under no_grad. Freezing dropped columns in the optimizer
(``balancer.freeze_dropped``) wraps the inner optimizer's ``step`` (fp32 master weights under
mixed precision), see :meth:`LayerOps.install_freeze`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from colossal_hetero.balance.inlayer import InLayerPlan, Offload
from colossal_hetero.balance.ops.migrate import Migration
from colossal_hetero.balance.ops.multi import MultiMigration
from colossal_hetero.balance.ops.resize import (
    IMPUTE_MODES,
    FreezeTargets,
    ZeroResize,
    complement,
    freeze_on_step,
    reduction_dim,
    reduction_width,
)
from colossal_hetero.balance.ops.selection import (
    PRIORITY_RULES,
    MigrationSplit,
    PriorityTracker,
    priority_order,
)
from colossal_hetero.layers.linear import (
    ResizableConv1DCol,
    ResizableConv1DRow,
    ResizableLinearCol,
    ResizableLinearRow,
    ResizableParallelModule,
)

LINEAR = (ResizableLinearCol, ResizableLinearRow, ResizableConv1DCol, ResizableConv1DRow)
"""The layers whose local product is ``_local_linear`` (the vocab embedding is not one)."""


def _count(width: int, fraction: float) -> int:
    """Columns for ``fraction`` of ``width`` (rounded; 9 decimals against float noise)."""
    return min(width, int(round(round(width * fraction, 9))))


class LayerOps:
    """The resizable layers of one rank's model shard and the ops attached to them.

    Args:
        model: the (unwrapped) model shard; its resizable layers are found once per attach.
        impute_value: the value dropped gradient entries get (resize.py).
        impute: a resized straggler's imputation, ``"zero"`` or ``"mean"`` (resize.py;
            a migrate+resize straggler's dropped columns always take ``impute_value``).
        priority: the trackers' rule (``ops.selection.PRIORITY_RULES``): ``"magnitude"``
            (column weight norms, the default) or ``"change"`` (the authors' recent weight
            change with stale scores); docs/balancing-ops.md, "Priority rule under AdamW".
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        impute_value: float = 0.0,
        impute: str = "zero",
        priority: str = "magnitude",
    ) -> None:
        if impute not in IMPUTE_MODES:
            raise ValueError(f"impute must be one of {IMPUTE_MODES}, got {impute!r}")
        if priority not in PRIORITY_RULES:
            raise ValueError(f"priority must be one of {PRIORITY_RULES}, got {priority!r}")
        self.priority = priority
        self.model, self.impute_value, self.impute = model, impute_value, impute
        self.plan = InLayerPlan()
        self._trackers: dict[int, PriorityTracker] = {}  # by layer index; see ``refresh``
        self._migrations: list[MultiMigration] = []
        self.bytes_retired = 0  # bytes sent by migrations already removed

    def layers(self) -> list[ResizableParallelModule]:
        return [m for m in self.model.modules() if isinstance(m, LINEAR)]

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent for migrations since construction."""
        return self.bytes_retired + sum(op.bytes_sent for op in self._migrations)

    def clear(self) -> None:
        """Remove every op (back to the plain layers); priority scores are kept."""
        self.bytes_retired = self.bytes_sent
        for layer in self.layers():
            layer.local_op = None
        self._migrations = []
        self.plan = InLayerPlan()

    def apply(self, plan: InLayerPlan) -> None:
        """Attach ``plan`` (the same on every rank) to every resizable layer."""
        self.clear()
        self.plan = plan
        for index, layer in enumerate(self.layers()):
            layer.local_op = self._op_for(index, layer, plan)

    def refresh(self) -> None:
        """Priority period boundary (an agreement), on every rank, ops attached or not:
        each layer's scores get the L1 weight change of the columns this rank computed since
        the last boundary (every column where it dropped none; dropped ones keep their stale
        score). A ZERO-resizing straggler then re-selects its kept columns (same count: the
        op's work does not change). Local only, no communication."""
        offload = self.plan.of(self._rank())
        resizing = offload is not None and offload.dropped > 0
        for index, layer in enumerate(self.layers()):
            tracker, op = self._tracker(index, layer), layer.local_op
            width = reduction_width(layer, layer.rank)
            dropped = _dropped(layer)
            computed = torch.arange(width) if dropped is None else complement(dropped.cpu(), width)
            tracker.refresh(layer.weight, computed)
            if not resizing:
                continue
            if isinstance(op, ZeroResize):
                op.kept = _top(tracker.scores, op.kept.numel(), width).to(op.kept.device)
            elif isinstance(op, MultiMigration):
                for mig in op.ops:
                    if mig.straggler == layer.rank:
                        mig.split = _local_split(mig.split, tracker.scores, width)

    def freeze_targets(self, optimizer: Any) -> list[tuple[nn.Parameter, int, torch.Tensor]]:
        """(optimizer's parameter, reduction dim, dropped columns) of this rank's resized
        layers; under mixed precision the parameter is the fp32 master of the weight."""
        masters = getattr(optimizer, "working_to_master_map", None) or {}
        targets = []
        for layer in self.layers():
            dropped = _dropped(layer)
            if dropped is not None and dropped.numel():
                weight: nn.Parameter = layer.weight  # type: ignore[assignment]
                param = masters.get(weight, weight)
                targets.append((param, reduction_dim(layer), dropped.to(param.device)))
        return targets

    def install_freeze(self, optimizer: Any) -> None:
        """Run the inner optimizer's ``step`` with the dropped columns frozen (parameter and
        state restored: no momentum or weight-decay drift). Wraps the instance's method."""

        def targets() -> FreezeTargets:
            return self.freeze_targets(optimizer) if not self.plan.empty else []

        freeze_on_step(optimizer, targets)

    # -- building the ops --------------------------------------------------------------------

    def _rank(self) -> int:
        layers = self.layers()
        return layers[0].rank if layers else 0

    def _op_for(self, index: int, layer: ResizableParallelModule, plan: InLayerPlan) -> Any:
        me = layer.rank
        mine = plan.of(me)
        if mine is not None and mine.migrated == 0:
            return self._resize_op(index, layer, mine)
        ops = []
        for offload in plan.migrating:
            width = reduction_width(layer, offload.rank)
            if width == 0:
                continue
            split = _shared_split(width, offload, len(plan.helpers))
            if offload.rank == me and split.dropped.numel():
                tracker = self._tracker(index, layer)
                split = _local_split(split, tracker.scores, width)
            ops.append(Migration(offload.rank, plan.helpers, split, impute_value=self.impute_value))
        if not ops:
            return None
        op = MultiMigration(ops)
        self._migrations.append(op)
        return op

    def _resize_op(self, index: int, layer: ResizableParallelModule, mine: Offload) -> Any:
        width = reduction_width(layer, layer.rank)
        drop = _count(width, mine.dropped)
        if width == 0 or drop == 0:
            return None
        tracker = self._tracker(index, layer)
        kept = _top(tracker.scores, width - drop, width).to(layer.weight.device)
        return ZeroResize(layer.rank, kept, impute=self.impute, impute_value=self.impute_value)

    def _tracker(self, index: int, layer: ResizableParallelModule) -> PriorityTracker:
        """Layer ``index``'s tracker, made on first use (scores at ones, the weight now as the
        snapshot), or anew when a width move changed its reduction width; one whose weight
        changed shape otherwise keeps its scores and rebases at its next ``refresh``."""
        tracker = self._trackers.get(index)
        if tracker is None or tracker.scores.numel() != reduction_width(layer, layer.rank):
            tracker = PriorityTracker(layer.weight, reduction_dim(layer), rule=self.priority)
            self._trackers[index] = tracker
        return tracker


def _top(scores: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """The ``count`` highest-priority columns of ``width``, ascending."""
    assert scores.numel() == width
    return priority_order(scores)[:count].sort().values


def _shared_split(width: int, offload: Offload, helpers: int) -> MigrationSplit:
    """The split every rank agrees on: the last ``migrated`` columns in index order, in
    contiguous near-equal slices per helper; the dropped ones the last before them."""
    migrate = _count(width, offload.migrated)
    drop = min(_count(width, offload.dropped), width - migrate)
    keep = width - migrate - drop
    order = torch.arange(width)
    base, extra = divmod(migrate, helpers)
    sizes = [base + (1 if h < extra else 0) for h in range(helpers)]
    migrated = tuple(order[keep + drop :].split(sizes))
    return MigrationSplit(order[:keep], migrated, order[keep : keep + drop])


def _local_split(split: MigrationSplit, scores: torch.Tensor, width: int) -> MigrationSplit:
    """``split`` with its non-migrated columns re-divided by this rank's priority: the
    highest computed, the lowest dropped (the helpers never see this part)."""
    moved = torch.cat([torch.empty(0, dtype=torch.long), *split.migrated])
    rest = complement(moved.sort().values, width)
    order = rest[priority_order(scores[rest])]
    keep = rest.numel() - split.dropped.numel()
    return MigrationSplit(order[:keep].sort().values, split.migrated, order[keep:].sort().values)


def _dropped(layer: ResizableParallelModule) -> torch.Tensor | None:
    op = layer.local_op
    if isinstance(op, ZeroResize):
        return op.dropped(layer)
    if isinstance(op, MultiMigration):
        for mig in op.ops:
            if mig.straggler == layer.rank:
                return mig.split.dropped
    return None
