"""In-layer balancing ops for tensor-parallel stragglers (issue 9, the layer-operation half).

- ``selection`` (pure): the kept fraction from a measured slowdown, the migrated fraction,
  priority scores and their stale-score update, the kept/migrated/dropped split;
- ``resize``: ZERO-resizing (a straggler computes a kept subset of the reduction dimension,
  the dropped gradients imputed by a constant, or the inputs by their token mean) and
  freezing the dropped columns in the optimizer;
- ``migrate``: lossless lightweight migration of a straggler's lowest-priority columns to
  helper ranks, column- and row-parallel, with a byte counter.

Each op is a resizable layer's ``local_op`` (layers/linear.py): the layer's collectives are
untouched and no op runs in eval or under no_grad. Choosing and attaching ops at run time is
the controller's job (balance/actuator.py; see docs/balancing-ops.md). ``multi`` serves
several migrating stragglers with the same helpers.
"""

from colossal_hetero.balance.ops.migrate import Migration, attach_migration
from colossal_hetero.balance.ops.multi import MultiMigration
from colossal_hetero.balance.ops.resize import (
    IMPUTE_MODES,
    ZeroResize,
    attach_resize,
    complement,
    freeze_targets,
    frozen_columns,
    mean_imputed_linear,
    reduction_dim,
    reduction_width,
    resized_linear,
)
from colossal_hetero.balance.ops.selection import (
    PRIORITY_RULES,
    MigrationSplit,
    PriorityTracker,
    column_change,
    column_norm,
    kept_count,
    kept_fraction,
    migrated_fraction,
    priority_order,
    select_kept,
    split_migration,
    update_scores,
)

__all__ = [
    "IMPUTE_MODES",
    "Migration",
    "MigrationSplit",
    "MultiMigration",
    "PRIORITY_RULES",
    "PriorityTracker",
    "ZeroResize",
    "attach_migration",
    "attach_resize",
    "column_change",
    "column_norm",
    "complement",
    "freeze_targets",
    "frozen_columns",
    "kept_count",
    "kept_fraction",
    "mean_imputed_linear",
    "migrated_fraction",
    "priority_order",
    "reduction_dim",
    "reduction_width",
    "resized_linear",
    "select_kept",
    "split_migration",
    "update_scores",
]
