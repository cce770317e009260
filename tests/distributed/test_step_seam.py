"""A plain Booster loop (no trainer, no timer calls) gets step boundaries from the plugin.

Rank 1 is emulated 3x slow. Assertions use the interceptor's accounting (stretch time, counts,
step numbers), never wall-clock ratios, so machine load cannot fail them. One spawn groups
the checks: TP=2 (with a second plugin beside the first, and a conflicting one refused),
then PP=2 in the same processes (plugins one after another).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from colossalai.booster import Booster

from colossal_hetero.config.schema import (
    EmulationConfig,
    HeteroConfig,
    ParallelConfig,
    SlowdownSpec,
)
from colossal_hetero.metrics import rank_metrics_path, read_metrics
from colossal_hetero.models import build_model, loss_from_outputs
from colossal_hetero.plugin import HeteroParallelPlugin
from tests.dist_utils import run_distributed
from tests.tiny_models import GPT2

SLOW = EmulationConfig(compute=[SlowdownSpec(rank=1, factor=3.0)])


def _batch(device: torch.device, size: int = 4) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (size, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return {k: v.to(device) for k, v in batch.items()}


class _Recorder:
    """A seam controller that records the hooks it sees."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_step_begin(self, step: int) -> None:
        self.events.append(("begin", step))

    def on_step_end(self, step: int, timing: Any) -> None:
        assert timing.step == step
        self.events.append(("end", step))


def _boost(plugin: HeteroParallelPlugin) -> tuple[Booster, Any, Any, Any]:
    model = build_model(GPT2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(plugin=plugin)
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, loss_from_outputs)
    return booster, model, optimizer, criterion


def _train_step(booster: Booster, model: Any, optimizer: Any, criterion: Any, batch: dict) -> float:
    loss = criterion(model(**batch), batch)
    booster.backward(loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()
    return float(loss)


def _tp2(rank: int, world_size: int, device: torch.device, folder: str) -> None:
    config = HeteroConfig(parallel=ParallelConfig(tp=2), emulation=SLOW)
    plugin = HeteroParallelPlugin(config, metrics_dir=folder)
    try:
        recorder = plugin.seam.add(_Recorder())
        booster, model, optimizer, criterion = _boost(plugin)
        batch, timings, losses = _batch(device), [], []
        for _ in range(3):  # automatic: opened by the forward, closed by optimizer.step()
            losses.append(_train_step(booster, model, optimizer, criterion, batch))
            assert plugin.seam.open_step is None and plugin.seam.loss == losses[-1]
            timings.append(plugin.seam.last_timing)
            model.eval()  # validation forwards open no step
            with torch.no_grad():
                model(**batch)
            model.train()
            with torch.no_grad():
                model(**batch)
            assert plugin.seam.open_step is None
        _explicit_steps(plugin, booster, model, optimizer, criterion, batch, timings, losses)
        assert recorder.events == [(e, s) for s in (0, 1, 2, 10, 11, 12) for e in ("begin", "end")]
        _side_by_side(config)
    finally:
        plugin.close()
    assert [t.step for t in timings] == [0, 1, 2, 10, 11, 12]
    for timing in timings:
        assert timing.num_collectives > 0  # TP all-reduces inside the step
        if rank == 1:
            assert timing.stretch_time > 0.0
        else:
            assert timing.stretch_time == 0.0  # exact: rank 0 never sleeps for compute
    records = read_metrics(rank_metrics_path(folder, rank))
    assert [r.step for r in records] == [0, 1, 2, 10, 11, 12]  # one record per step
    assert [r.loss for r in records] == losses
    assert [r.stretch_time for r in records] == [t.stretch_time for t in timings]


def _explicit_steps(
    plugin: HeteroParallelPlugin,
    booster: Booster,
    model: Any,
    optimizer: Any,
    criterion: Any,
    batch: dict,
    timings: list,
    losses: list,
) -> None:
    """begin_step/end_step called by the user, mixed with the automatic driving."""
    seam = plugin.seam
    seam.begin_step(10)  # explicit open; the forward does not reopen, the optimizer closes
    losses.append(_train_step(booster, model, optimizer, criterion, batch))
    assert seam.open_step is None
    timings.append(seam.end_step())  # fetches the step the optimizer closed
    with pytest.raises(RuntimeError, match="without an open step"):
        seam.end_step()
    seam.begin_step()  # numbered after the last: 11; closed explicitly before the optimizer
    loss = criterion(model(**batch), batch)
    booster.backward(loss, optimizer)
    timings.append(seam.end_step())
    losses.append(float(loss))
    optimizer.step()  # no step open: nothing to close, nothing opened
    optimizer.zero_grad()
    assert seam.open_step is None
    losses.append(_train_step(booster, model, optimizer, criterion, batch))  # automatic: 12
    timings.append(seam.last_timing)


def _side_by_side(config: HeteroConfig) -> None:
    """A second plugin beside the first; a conflicting one is refused before any group."""
    second = HeteroParallelPlugin(config)  # the same emulation: fine
    try:
        booster, model, optimizer, criterion = _boost(second)
        _train_step(booster, model, optimizer, criterion, _batch(torch.device("cpu")))
        assert second.seam.last_timing is not None and second.seam.last_timing.step == 0
    finally:
        second.close()
    groups = len(c10d._world.pg_map)
    other = EmulationConfig(compute=[SlowdownSpec(rank=1, factor=2.0)])
    with pytest.raises(ValueError, match=r"^emulation\.compute: differs"):
        HeteroParallelPlugin(HeteroConfig(parallel=ParallelConfig(tp=2), emulation=other))
    assert len(c10d._world.pg_map) == groups  # refused before any process group was made
    dist.barrier()  # every rank refused: none waits in a group the others never made


def _pp2(rank: int, world_size: int, device: torch.device, folder: str) -> None:
    config = HeteroConfig(parallel=ParallelConfig(pp=2, num_microbatches=2), emulation=SLOW)
    plugin = HeteroParallelPlugin(config, metrics_dir=folder)
    try:
        booster, model, optimizer, criterion = _boost(plugin)
        batch, losses, timings = _batch(device), [], []
        for step in range(2):
            result = booster.execute_pipeline(
                iter([batch]), model, criterion, optimizer, return_loss=True
            )
            assert plugin.seam.open_step == step  # spans both micro-batches until the step
            optimizer.step()
            optimizer.zero_grad()
            timings.append(plugin.seam.last_timing)
            losses.append(None if result["loss"] is None else float(result["loss"]))
            plugin.forward_pipeline(iter([batch]), model, criterion)  # validation: no step
            assert plugin.seam.open_step is None
    finally:
        plugin.close()
    assert [t.step for t in timings] == [0, 1]
    assert all(t.num_collectives > 0 for t in timings)  # activations and gradients crossed
    assert all((t.stretch_time > 0.0) == (rank == 1) for t in timings)
    records = read_metrics(rank_metrics_path(folder, rank))
    assert [r.step for r in records] == [0, 1]
    assert [r.loss for r in records] == losses
    assert (losses[0] is None) == (rank == 0)  # only the last stage sees the loss


def _both(rank: int, world_size: int, device: torch.device, folder: str) -> None:
    """TP=2 then PP=2 in one process: plugins one after another as well as side by side."""
    _tp2(rank, world_size, device, str(Path(folder) / "tp2"))
    _pp2(rank, world_size, device, str(Path(folder) / "pp2"))


@pytest.mark.dist
def test_plain_booster_loop_steps_emulation_metrics_and_several_plugins(tmp_path: Path):
    run_distributed(_both, world_size=2, folder=str(tmp_path), force_cpu=True)
