"""The balancer in a plain Booster loop (no trainer): detect, re-plan, resize, move back.

TP=2 tiny GPT-2 on 2 gloo ranks, Adam. Rank 1 is emulated 4x slow from step SLOW_FROM to
step SLOW_UNTIL. Checks, grouped in one spawn:

- the detector flags rank 1 within two agreements of SLOW_FROM, and every agreement's
  detection (vector, flags, stability) is identical on both ranks (gathered and compared);
- replan resizes toward the fast rank (rank 0 gains heads and ffn features) while the slowdown
  lasts (the move back after recovery is checked deterministically in
  tests/unit/test_balance_controller.py: here it depends on how much of the tiny model's step
  does not scale with the widths, which machine load changes);
- the decisions are in ``balance_rank{r}.jsonl`` beside the metrics, with a measured-gain
  record after each move, and identical on both ranks;
- exactness: the losses equal, bitwise, an undisturbed run (no emulation, no balancer) that
  calls ``plugin.resize`` at the same steps to the same widths. Like with like (see
  tests/restart.py): the same kernels on the same shard shapes in the same order, so any
  difference would be the balancer disturbing training; the balancer's own gather runs
  between steps and touches no tensor of the model. (A run at even widths throughout is no
  reference: other shard shapes sum in another order, and Adam turns rounding noise into
  O(lr) weight differences.)
- one all_gather per ``every`` steps: the controller's agreement count is steps / every.

Assertions use the interceptor's accounting and the emulated factor (4x on the CPU-time
compute, far above the 1.15 threshold and the 0.25 stability tolerance); none bounds a time.
The interceptor's clock reads CPU time plus its requested sleeps
(tests/distributed/accounted_clock.py), so the compute the detector reads does not move with
machine load.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from colossalai.booster import Booster

from colossal_hetero.balance.controller import balance_log_path
from colossal_hetero.config.schema import (
    BalancerConfig,
    EmulationConfig,
    HeteroConfig,
    ParallelConfig,
    PlanConfig,
    SlowdownSpec,
)
from colossal_hetero.models import build_model, loss_from_outputs
from colossal_hetero.plugin import HeteroParallelPlugin
from colossal_hetero.policies import resizable_policy
from tests.dist_utils import run_distributed
from tests.distributed.accounted_clock import account_in_cpu_time
from tests.tiny_models import GPT2 as TINY

# Wider than the tiny model, so that the compute the widths split is a good part of a step.
GPT2 = replace(TINY, hf={**TINY.hf, "n_embd": 128, "n_inner": 512})

STEPS, SLOW_FROM, SLOW_UNTIL, EVERY = 36, 6, 18, 3
BALANCER = BalancerConfig(
    mode="replan",
    every=EVERY,
    window=EVERY,
    smoothing=0.8,
    stable_tolerance=0.25,
    stable_steps=3,
    horizon_steps=10_000,
    move_cost_s=0.01,
    fixed_fraction=0.5,  # the wider tiny model: about half a step scales with the widths
)
SLOW = EmulationConfig(
    compute=[SlowdownSpec(rank=1, factor=4.0, start_step=SLOW_FROM, end_step=SLOW_UNTIL)]
)
# A CPU-class device model (no probe at configure): compute dominates the tiny model's plan.
PLAN = PlanConfig(reference_tflops=0.01)


def _batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(step % 4))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _run(
    config: HeteroConfig, folder: str | None, moves: dict[int, dict], policy: Any = None
) -> tuple[list, Any]:
    """Train STEPS steps; ``moves``: step -> widths to resize to after that step's update."""
    plugin = HeteroParallelPlugin(config, metrics_dir=folder, workload=(4, 16), policy=policy)
    account_in_cpu_time(plugin.timer)
    try:
        torch.manual_seed(0)
        model = build_model(GPT2)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        booster = Booster(plugin=plugin)
        model, optimizer, criterion, _, _ = booster.boost(model, optimizer, loss_from_outputs)
        losses = []
        for step in range(STEPS):
            batch = _batch(step)
            loss = criterion(model(**batch), batch)
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
            if step in moves:
                plugin.resize(model, optimizer, moves[step])
        return losses, plugin.balancer
    finally:
        plugin.close()


def _check(rank: int, world_size: int, device: torch.device, folder: str) -> None:
    config = HeteroConfig(
        parallel=ParallelConfig(tp=2), emulation=SLOW, plan=PLAN, balancer=BALANCER
    )
    losses, controller = _run(config, folder, {})
    assert len(controller.agree_s) == STEPS // EVERY  # one gather per EVERY steps
    detections = [(d.step, d.slowdown, d.stragglers, d.stable_since) for d in controller.detections]
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, detections)
    assert everyone[0] == everyone[1]  # identical on every rank, bit for bit
    flagged = [d.step for d in controller.detections if d.stragglers == (1,)]
    assert flagged and flagged[0] <= SLOW_FROM + 2 * EVERY, flagged

    records = [json.loads(line) for line in balance_log_path(folder, rank).open()]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, records)
    assert everyone[0] == everyone[1]
    assert all(
        {"step", "controller", "inputs", "decision", "predicted_gain"} <= set(r) for r in records
    )
    moves = {
        r["step"]: r["decision"]["widths"] for r in records if r["decision"]["action"] == "resize"
    }
    measured = [r for r in records if r["decision"]["action"] == "measured"]
    steps = sorted(moves)
    assert moves and len(measured) == len([s for s in steps if s + EVERY < STEPS]), records
    # While rank 1 is slow some move gives rank 0 more heads and ffn features. (Moves before
    # the slowdown are not ruled out: a loaded host can make a rank look slow for a while.)
    toward = [
        step
        for step in steps
        if SLOW_FROM <= step < SLOW_UNTIL
        and moves[step]["heads"][0] > moves[step]["heads"][1]
        and moves[step]["ffn"][0] > moves[step]["ffn"][1]
    ]
    assert toward, records
    assert all(r["predicted_gain"] > 0 for r in records if r["decision"]["action"] == "resize")

    undisturbed = HeteroConfig(parallel=ParallelConfig(tp=2), plan=PLAN)
    even = resizable_policy(build_model(GPT2), {})  # resizable layers, no balancer
    expected, none = _run(undisturbed, None, dict(moves), even)
    assert none is None
    assert losses == expected  # bitwise: the balancer changes nothing but the widths


@pytest.mark.slow  # two 36-step runs: about 2 minutes on 2 busy cores
@pytest.mark.dist
def test_replan_detects_resizes_moves_back_and_trains_exactly(tmp_path: Path):
    run_distributed(_check, world_size=2, folder=str(tmp_path), force_cpu=True)
