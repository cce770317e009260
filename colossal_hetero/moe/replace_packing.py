"""Packing-aware re-placement at run time: measured inputs of the packing objective.

With ``moe.packing`` and ``moe.replace_every`` both on, the re-placement controller
(:class:`.replace.ExpertReplacer`) decides with the objective of :mod:`.packing` (the slowest
rank's expert compute plus the packed a2a sends, :func:`.replace_policy.
decide_packing_placements`) instead of compute alone. :class:`PackingMeter` gathers its
inputs between two decisions, so that every rank decides from identical numbers:

- *Routing*: per MoE layer, a histogram of the top-k expert **sets** the router chose, one
  row per source ep rank (``[ep, C(E, k)]``; forward hooks on the gates, training forwards
  only), summed over the world by one integer all-reduce (exact, so identical everywhere).
  Why a histogram and not the co-selection pair counts or a sample of rows: the packed send
  count of a placement is a function of each token's expert set and source rank, so the
  histogram gives it exactly for any k (pair counts do only for k = 2: a token whose three
  experts share a rank saves two sends, not three), and its size does not grow with the
  tokens: C(8, 2) = 28 sets per source rank for Mixtral's 8 experts, top-2. Beyond
  :data:`MAX_SUBSETS` sets per layer the controller keeps the compute objective (noted in
  each record).
- *seconds_per_token*: one (token, expert) row's expert compute, forward and backward, at
  speed 1. Read off the step's a2a log (moe/comm.py), where it is already measured: inside
  each pending span (one block's forward exchange, or its backward) the gap from the
  second-to-last a2a's end to the last one's launch is the expert compute (dispatch end to
  combine launch; in backward, the combine's reverse to the dispatch's reverse). The launch
  is stamped after the issue returns, so an emulated slow rank's stretch is inside the gap.
  Each rank's gaps times its speed (cluster.devices) are summed over the world and divided
  by the world's (token, expert) rows (the histogram's total): every row is computed once.
- *seconds_per_byte*: the a2a's time per byte beyond its fixed cost, from the same log: per
  step, every a2a call's time less the step's shortest call (latency-bound), over the bytes
  the rank sent. Agreed as the **minimum** over ranks: a rank that reaches an a2a before a
  slower peer waits inside the call, so its time per byte holds that wait; the rank that
  arrived last waited for nobody. With per-send bytes (:class:`.replace_policy.PackingCosts`)
  that gives ``seconds_per_send``.

The per-rank sums are exchanged by one ``all_gather`` and reduced in rank order on every
rank (bit-identical results). Without a measurement (no logged a2a, ``moe.log_events``
off, or nothing routed) the decision falls back to the compute objective, noted in the record.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colossal_hetero.moe.packing import Routing, subset_index
from colossal_hetero.moe.placement import Placement
from colossal_hetero.moe.replace_policy import (
    PackingCosts,
    decide_packing_placements,
    decide_placements,
)
from colossal_hetero.utils.collectives import all_gather_anywhere, all_reduce_anywhere

MAX_SUBSETS = 4096
"""Most top-k sets per layer (C(E, k)) the routing histogram keeps; beyond: compute objective."""

LogRow = Sequence[Any]


def step_costs(log: Sequence[LogRow]) -> tuple[float, float, int]:
    """(expert seconds, a2a seconds beyond latency, a2a bytes sent) of one step's log rows
    ``(kind, group, id, t_launch, t_done, nbytes)`` (pure; see the module)."""
    calls = sorted((row for row in log if row[0] == "a2a"), key=lambda row: row[3])
    expert = 0.0
    for span in (row for row in log if row[0] == "pending"):
        inside = [c for c in calls if span[3] <= c[3] <= span[4]]
        if len(inside) >= 2:
            expert += max(0.0, inside[-1][3] - inside[-2][4])
    if not calls:
        return expert, 0.0, 0
    durations = [max(0.0, c[4] - c[3]) for c in calls]
    latency = min(durations)
    return expert, sum(d - latency for d in durations), sum(int(c[5]) for c in calls)


def agree_costs(
    per_rank: Sequence[Sequence[float]], rows: int, hidden: int, itemsize: int, ep: int, width: int
) -> PackingCosts | None:
    """The agreed costs from every rank's ``[expert seconds * speed, a2a excess seconds, a2a
    bytes]`` and the world's (token, expert) ``rows`` (pure): None without a measurement."""
    expert = math.fsum(row[0] for row in per_rank)
    per_byte = [row[1] / row[2] for row in per_rank if row[2] > 0]
    if rows <= 0 or expert <= 0 or not per_byte or min(per_byte) <= 0:
        return None
    return PackingCosts(expert / rows, min(per_byte), hidden, itemsize, ep, width)


def routed_choices(block: Any, logits: torch.Tensor) -> torch.Tensor | None:
    """The experts each token of a training forward chose, ``[tokens, top_k]`` on the host,
    from the gate's ``logits``; None in validation or under no_grad (neither steers placement).
    The routing both re-placement meters count (here and moe/replace.py)."""
    if not (block.training and torch.is_grad_enabled()):
        return None
    with torch.no_grad():
        return logits.topk(block.top_k, dim=-1).indices.cpu()


class PackingMeter:
    """Routing histogram and measured costs for the packing-aware decision (see the module)."""

    def __init__(self, blocks: Sequence[Any], speeds: Sequence[float]) -> None:
        self.blocks = list(blocks)
        block = self.blocks[0]
        self.experts, self.k, self.ep = block.num_experts, block.top_k, block.ep_size
        self.speed = float(speeds[dist.get_rank()])
        self.sets = math.comb(self.experts, self.k)
        self.note = None if self.sets <= MAX_SUBSETS else f"C(E, k) = {self.sets} top-k sets"
        self.counts = torch.zeros(len(self.blocks), self.ep, self.sets, dtype=torch.long)
        self.measured = [0.0, 0.0, 0.0]  # expert s * speed, a2a excess s, a2a bytes
        self._hooks = []
        if self.note is None:
            self._hooks = [
                b.gate.register_forward_hook(self._hook(i)) for i, b in enumerate(blocks)
            ]

    def _hook(self, layer: int) -> Any:
        def count(module: nn.Module, inputs: Any, logits: torch.Tensor) -> None:
            block = self.blocks[layer]
            chosen = routed_choices(block, logits)
            if chosen is None:
                return
            index = torch.from_numpy(subset_index(chosen.numpy(), self.experts))
            row = self.counts[layer, block.ep_rank]
            row += torch.bincount(index, minlength=self.sets)

        return count

    def observe_step(self) -> None:
        """Add this step's expert compute and a2a time and bytes (the comm's step log)."""
        expert, excess, nbytes = step_costs(self.blocks[0].comm.step_log())
        self.measured[0] += expert * self.speed
        self.measured[1] += excess
        self.measured[2] += nbytes

    def decide(
        self,
        loads: torch.Tensor,
        speeds: Sequence[float],
        capacity: int,
        current: Sequence[Placement],
        min_gain: float,
    ) -> tuple[list[Placement], dict[str, Any]]:
        """The decision (collective: one all-reduce and one all-gather); ``loads`` the world's
        loads for the compute-objective fallback. Resets the histogram and the measurements."""
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        all_reduce_anywhere(counts)
        mine = torch.tensor(self.measured, dtype=torch.float64)
        self.measured = [0.0, 0.0, 0.0]
        gathered = all_gather_anywhere(mine)
        block = self.blocks[0]
        itemsize = next(block.gate.parameters()).element_size()
        width = -(-self.experts // self.ep)
        rows = int(counts.sum()) * self.k  # (token, expert) rows of every layer
        per_rank = [t.tolist() for t in gathered]
        costs = agree_costs(per_rank, rows, block.hidden_dim, itemsize, self.ep, width)
        if self.note is None and costs is not None:
            routings = [
                Routing.from_histogram(counts[layer].numpy(), self.experts, self.k)
                for layer in range(len(self.blocks))
            ]
            return decide_packing_placements(routings, speeds, capacity, current, costs, min_gain)
        new, record = decide_placements(loads.tolist(), speeds, capacity, current, min_gain)
        why = self.note or "no measured expert compute or a2a time"
        record["objective"] = "compute"
        record["note"] = f"packing objective not used: {why}"
        return new, record

    def state(self) -> torch.Tensor:
        """The histogram counted since the last decision, summed over the world (collective)."""
        counts = self.counts.clone()
        all_reduce_anywhere(counts)
        return counts

    def restore(self, counts: torch.Tensor) -> None:
        """Count a saved :meth:`state` towards the next decision (once: on rank 0)."""
        counts = counts.to(torch.long)
        self.counts = counts if dist.get_rank() == 0 else torch.zeros_like(counts)

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
