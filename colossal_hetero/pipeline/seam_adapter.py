"""The plugin's pipeline schedule from ``parallel.pp_schedule``, and ada_kfkb's seam controller.

:func:`install_schedule` replaces the engine's 1F1B with :class:`KFKBSchedule` (kfkb and
ada_kfkb) and, for ada_kfkb, returns an :class:`AdaKSeamController` for the plugin's step seam:
after every step it calls :meth:`AdaKController.after_step` (one ``all_gather`` every
``parallel.pp_retune_every`` steps, on every rank, over a group of its own; it runs in the
background and is decided before the next step's first ``k``-dependent pass) and writes each
decision record.

Link time is measured online (``KFKBSchedule.last_record``'s per-message timestamps; see
``pipeline/profile.py``), not taken from the config.

Memory budget: ``parallel.pp_memory_budget_mib`` when set; otherwise detected on each rank as
``DETECTED_BUDGET_SHARE`` of what it could still allocate after the model and optimizer were
built (``utils.device.available_memory_bytes``: free accelerator memory, this rank's share
of the host's available memory on CPU). Ranks may detect different budgets; the controller's
gather takes each stage's smallest, so the decision is still the same everywhere.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Protocol

import torch
import torch.distributed as dist

from colossal_hetero.config.schema import HeteroConfig
from colossal_hetero.pipeline.controller import AdaKController
from colossal_hetero.pipeline.link_shares import LinkShareTuner
from colossal_hetero.pipeline.measured import MeasuredGuard
from colossal_hetero.pipeline.schedule import KFKBSchedule
from colossal_hetero.pipeline.tuner import stage_of_rank, tp_index_of_rank
from colossal_hetero.pipeline.validate import budget_bytes, check_budget
from colossal_hetero.utils.collectives import all_reduce_anywhere
from colossal_hetero.utils.device import HOST_BACKEND, available_memory_bytes, current_device

DETECTED_BUDGET_SHARE = 0.5
"""Share of the detected free memory ada_kfkb may fill with in-flight activations (the rest is
headroom for gradients, optimizer temporaries and the allocator)."""
WINDOW = 4
"""Retuning steps the plugin's controller sums its prediction over (``AdaKController.window``)."""
MIN_GAIN = 0.03
"""Predicted gains below this tie (the smaller k wins): measured compute jitters by a few %."""
EXPLORE = 0.15
"""A neighbouring k predicted at most this much slower than the running one is tried for one
period (``MeasuredGuard.explore``): predicted from a profile measured at another k, PP=4 steps
at k = 3 put k = 2 within 12% of it, where k = 2 ran 10-15% faster."""
MEMORY = 8
"""Retunings a measured step time stays recent (``MeasuredGuard.memory``)."""
SETTLE = 3
"""Retunings in a row at the running k before a neighbour is explored, and how many of its step
times the guard's median takes (``MeasuredGuard.settle``)."""
SHARE_MIN_GAIN = 0.25
"""New link units must land a message this much sooner than the running ones (by the measured
link estimates) to replace them (``link_shares.choose_units``). A link time read from a step's
few waited receives jitters: at 10% (and one step's estimates) the bench's free PP=2 x TP=2
links flapped between 2:14 and 14:2; a tenant's link is 5-10x slower, a gain of 50-80%."""
SHARE_WINDOW = 4
"""Measured steps whose per-link estimates the units follow (median; ``LinkShareTuner``)."""
SHARE_STEP_GAIN = 0.01
"""New link units must also make the simulated step this much faster (``LinkShareTuner``'s
``min_step_gain``): links whose transfers hide behind compute gain nothing from moving. At
3% the bench's PP=2 x TP=2 kept equal pieces under the tenant for all but the last 2 of 16
rounds: at k = 2 the simulator hides most of a 25-90 ms activation behind the passes."""
MEASURED_MARGIN = 0.10
"""Measured step times closer than this do not overrule the simulator (``MeasuredGuard.margin``):
on the shared 2-core host one k's steps moved 5-10% round to round."""


class RecordWriter(Protocol):
    """Takes one decision record (``metrics.decisions.DecisionWriter``)."""

    def write(self, record: dict[str, Any]) -> None: ...


class AdaKSeamController:
    """Step-seam controller running ada_kfkb's retuning at step ends, on every rank.

    After the first step it checks ``parallel.pp_memory_budget_mib`` against the largest
    activation bytes per micro-batch measured on any rank (one float64 ``all_reduce(MAX)`` over
    the world), so a budget below one micro-batch raises the same ValueError on every rank.
    """

    def __init__(self, controller: AdaKController, config: HeteroConfig) -> None:
        self.controller, self.config = controller, config
        self.log: RecordWriter | None = None
        """Where decision records go (the plugin sets a ``DecisionWriter``); None drops them."""
        self._checked = False

    def on_step_end(self, step: int, timing: Any) -> None:
        stats = self.controller.schedule.last_stats
        if stats is None:  # the step ran no pipeline pass (nothing measured, nothing to tune)
            return
        if not self._checked:
            largest = torch.tensor([float(stats.activation_bytes)], dtype=torch.float64)
            all_reduce_anywhere(largest, dist.ReduceOp.MAX, self.controller.group)
            self._checked = True
            check_budget(self.config, float(largest.item()))
        record = self.controller.after_step(step)
        if record is not None and self.log is not None:
            self.log.write(record)

    def close(self) -> None:
        close = getattr(self.log, "close", None)
        if close is not None:
            close()


def install_schedule(engine: Any, config: HeteroConfig, rank: int) -> AdaKSeamController | None:
    """Install ``KFKBSchedule`` as ``engine.scheduler`` for kfkb / ada_kfkb (no-op for 1f1b).

    Returns the seam controller for ada_kfkb, else None. Raises ValueError naming
    ``parallel.pp_schedule`` when the pipeline group is not gloo (before any collective).
    """
    parallel = config.parallel
    if parallel.pp_schedule == "1f1b":
        return None
    schedule = KFKBSchedule(  # planned m and k (0) are set at configure (plugin/planning.py)
        engine.stage_manager,
        num_microbatches=parallel.num_microbatches,
        k=parallel.pp_k or 1,
        # 1D TP replicates activations over the stage's TP group: each rank sends its 1/tp.
        tp_group=engine.tp_group if parallel.tp > 1 else None,
    )
    engine.scheduler = schedule
    if parallel.pp_schedule != "ada_kfkb":
        return None
    world = dist.get_world_size()
    layout = stage_of_rank(parallel.pp, parallel.tp, world // (parallel.pp * parallel.tp))
    budget = budget_bytes(config)
    if budget is None:
        budget = detected_budget_bytes()
    controller = AdaKController(
        schedule,
        layout,
        # Nothing detected: the largest finite float, since the gathered rows must be finite.
        budget or sys.float_info.max,
        period=parallel.pp_retune_every,
        min_gain=MIN_GAIN,
        window=WINDOW,
        sticky=True,
        # A group of its own, so the gather overlaps the next step: no step's collective
        # queues behind it (every rank creates it here, in the same order).
        group=dist.new_group(backend=HOST_BACKEND),
        overlap=True,
        # Decided before the next step's first k-dependent pass: k changes one step after the
        # step it was measured on, not two (that step waits for the gather's rest, if any).
        early=True,
        guard=MeasuredGuard(margin=MEASURED_MARGIN, explore=EXPLORE, memory=MEMORY, settle=SETTLE),
        # The first retuning picks the fastest prediction: the start k was not chosen.
        start_free=True,
        link_shares=link_share_tuner(config, world),
    )
    return AdaKSeamController(controller, config)


def link_share_tuner(config: HeteroConfig, world: int) -> LinkShareTuner | None:
    """ada_kfkb's placement of message pieces over each stage's TP links
    (``parallel.pp_link_shares``), or None (off, or no TP group of several ranks)."""
    parallel = config.parallel
    if not parallel.pp_link_shares or parallel.tp < 2:
        return None
    dp = world // (parallel.pp * parallel.tp)
    layout = tp_index_of_rank(parallel.pp, parallel.tp, dp)
    return LinkShareTuner(
        parallel.pp, layout, parallel.tp, SHARE_MIN_GAIN, SHARE_WINDOW, SHARE_STEP_GAIN
    )


def detected_budget_bytes() -> float:
    """``DETECTED_BUDGET_SHARE`` of the bytes this rank could still allocate (0: unknown)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return DETECTED_BUDGET_SHARE * available_memory_bytes(current_device(), local)
