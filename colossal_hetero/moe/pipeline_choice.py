"""Choosing the number of a2a/expert pipelining ranges from measured inputs, between steps.

With ``moe.pipeline_auto`` (the default) ``moe.pipeline_chunks`` is the most token ranges a
block may use; the blocks start with one. After the first training step (the seam, through
:class:`.wiring.MoeStepLog`), every rank:

1. agrees on the rows one block dispatches per rank (the largest over the world: the blocks
   record it in forward);
2. times, on its ep group, all-to-alls of those rows' bytes split over ``most`` ranges and
   unsplit, and its held experts' forward and backward on the rows it would receive under
   even routing (median of ``REPEATS``; nothing accumulates into ``.grad``);
3. takes the world's maximum of every timing (the slowest rank sets the pace), so every rank
   fits the same a2a ``alpha``/``beta`` and feeds the same inputs to
   :func:`.pipeline_model.choose_ranges`, and sets the chosen number on every block.

The decision, its inputs and each candidate's prediction go into that step's ``moe`` log
record (``pipeline``). Collective: every rank calls :meth:`PipelineChooser.on_step_end` at
the same step boundary.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from colossal_hetero.moe.pipeline_model import ExchangeInputs, choose_ranges
from colossal_hetero.moe.profile import fit_alpha_beta

REPEATS = 5


def _median_time(run: Callable[[], Any], barrier: Callable[[], Any] | None = None) -> float:
    run()  # warm
    times = []
    for _ in range(REPEATS):
        if barrier is not None:
            barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_a2a(group: Any, nbytes: int) -> float:
    """Median seconds of an even all-to-all of ``nbytes`` sent per rank on ``group``."""
    ep = dist.get_world_size(group)
    numel = max(ep, nbytes // 4 // ep * ep)
    send, recv = torch.zeros(numel), torch.empty(numel)
    return _median_time(
        lambda: dist.all_to_all_single(recv, send, group=group),
        lambda: dist.barrier(group=group),
    )


def time_experts(block: Any, rows: int) -> tuple[float, float]:
    """(forward, backward) median seconds of ``block``'s held experts on ``rows`` rows shared
    evenly among them (the rows a rank receives under even routing)."""
    experts = [block.experts[e] for e in block.held]
    weight = next(experts[0].parameters())
    share = max(1, rows // len(experts))
    x = torch.randn(share, block.hidden_dim, dtype=weight.dtype).requires_grad_()
    params = [p for expert in experts for p in expert.parameters()]

    def forward() -> list[torch.Tensor]:
        with torch.enable_grad():
            return [e.w2(e.act_fn(e.w1(x)) * e.w3(x)) for e in experts]

    def backward() -> None:
        outs = forward()
        torch.autograd.grad(outs, [x, *params], [torch.ones_like(o) for o in outs])

    fwd = _median_time(forward)
    return fwd, max(0.0, _median_time(backward) - fwd)


class PipelineChooser:
    """Sets ``pipeline_chunks`` of ``blocks`` once, after the first training step (see the
    module); ``record`` keeps the decision."""

    def __init__(self, blocks: Sequence[Any], most: int) -> None:
        self.blocks, self.most = list(blocks), most
        self.record: dict[str, Any] | None = None

    def on_step_end(self, step: int) -> dict[str, Any] | None:
        """Decide after the first step whose forward dispatched rows; the record then."""
        if self.record is not None or not self.blocks:
            return None
        local = max(getattr(b, "dispatched_rows", 0) for b in self.blocks)
        agreed = torch.tensor([float(local)], dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        rows = int(agreed.item())
        if rows == 0:
            return None
        block = self.blocks[0]
        row_bytes = block.hidden_dim * next(block.experts[block.held[0]].parameters()).itemsize
        sizes = (max(1024, rows * row_bytes // self.most), max(2048, rows * row_bytes))
        timings = [time_a2a(block.ep_group, s) for s in sizes] + list(time_experts(block, rows))
        measured = torch.tensor(timings, dtype=torch.float64)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        t_small, t_large, fwd, bwd = measured.tolist()
        alpha, beta = fit_alpha_beta(sizes, (t_small, t_large))
        inputs = ExchangeInputs(alpha, beta, rows, row_bytes, fwd / rows, bwd / rows)
        ranges, record = choose_ranges(inputs, self.most)
        for b in self.blocks:
            b.pipeline_chunks = ranges
        self.record = {"step": step, **record, "a2a_times_s": [t_small, t_large]}
        return self.record
