"""Optimizer checkpoints under pipeline parallelism with an uneven stage split, and k changes.

A run on a [3, 1] stage split (kfkb, k=1, AdamW) trains 2 steps, saves model and optimizer,
and trains a third step: the reference. A fresh plugin (another initial model, kfkb with k=2)
loads the checkpoint: its optimizer states must equal the saved ones exactly, and its third step
must give the reference's loss and parameters bit for bit.

- 2 ranks, PP=2 (default suite): no uneven TP widths, so Colossal-AI's own format;
- 4 ranks, TP=2 x PP=2 with uneven widths (slow): our full-state format, one file per stage
  (checkpoint/optimizer_state.py), which before refused pipeline parallelism. It also loads the
  same checkpoint into a [2, 2] split: every parameter's states equal those saved by whichever
  stage held it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from colossalai.booster import Booster

from colossal_hetero.config import HeteroConfig, ParallelConfig
from colossal_hetero.models import build_model, loss_from_outputs
from colossal_hetero.plugin import HeteroParallelPlugin
from colossal_hetero.policies import resizable_policy
from tests.dist_utils import run_distributed
from tests.distributed.test_kfkb_schedule import GPT2, _batch

M = 4
UNEVEN = {"heads": (3, 1), "ffn": (96, 32)}


def _boost(config: HeteroConfig, seed: int, uneven: bool):
    policy = resizable_policy(build_model(GPT2), UNEVEN) if uneven else None
    plugin = HeteroParallelPlugin(config, policy=policy)
    torch.manual_seed(seed)
    model = build_model(GPT2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    booster = Booster(plugin=plugin)
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, loss_from_outputs)
    return plugin, booster, model, optimizer, criterion


def _step(booster, model, optimizer, criterion, step: int):
    batch = _batch(2 * M, seed=step)
    result = booster.execute_pipeline(iter([batch]), model, criterion, optimizer, return_loss=True)
    optimizer.step()
    optimizer.zero_grad()
    return None if result["loss"] is None else result["loss"].clone()


def _states(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    state = optimizer.optim.state
    return {
        name: {k: v.clone() for k, v in state[p].items() if torch.is_tensor(v)}
        for name, p in model.unwrap().named_parameters()
        if p in state
    }


def _run(rank, world_size, device, folder: str, tp: int):
    uneven = tp > 1
    parallel = dict(pp=2, tp=tp, num_microbatches=M, num_layers_per_stage=[3, 1])
    first = HeteroConfig(parallel=ParallelConfig(**parallel, pp_schedule="kfkb", pp_k=1))
    plugin, booster, model, optimizer, criterion = _boost(first, seed=0, uneven=uneven)
    try:
        for step in range(2):
            _step(booster, model, optimizer, criterion, step)
        booster.save_model(model, f"{folder}/model", shard=True)
        booster.save_optimizer(optimizer, f"{folder}/optimizer", shard=True)
        saved = _states(model, optimizer)
        want_loss = _step(booster, model, optimizer, criterion, 2)
        want = {n: p.detach().clone() for n, p in model.unwrap().named_parameters()}
    finally:
        plugin.close()
    if uneven:  # our format: one file per pipeline stage
        files = sorted(p.name for p in Path(folder, "optimizer").glob("full_optimizer*.pt"))
        assert files == ["full_optimizer_stage0.pt", "full_optimizer_stage1.pt"], files

    second = HeteroConfig(parallel=ParallelConfig(**parallel, pp_schedule="kfkb", pp_k=2))
    plugin, booster, model, optimizer, criterion = _boost(second, seed=1, uneven=uneven)
    try:
        booster.load_model(model, f"{folder}/model")
        booster.load_optimizer(optimizer, f"{folder}/optimizer")
        loaded = _states(model, optimizer)
        assert loaded.keys() == saved.keys() and saved, (sorted(loaded), sorted(saved))
        for name, tensors in saved.items():
            assert loaded[name].keys() == tensors.keys(), name
            for key, value in tensors.items():
                assert torch.equal(loaded[name][key], value), f"{name}.{key} rank {rank}"
        assert plugin.engine.scheduler.k == 2
        loss = _step(booster, model, optimizer, criterion, 2)
        got = {n: p.detach().clone() for n, p in model.unwrap().named_parameters()}
    finally:
        plugin.close()
    assert (loss is None) == (want_loss is None) and (loss is None or torch.equal(loss, want_loss))
    assert got.keys() == want.keys() and got
    for name, value in got.items():
        assert torch.equal(value, want[name]), f"{name} differs after resuming, rank {rank}"
    if uneven:
        _load_into_another_split(rank, world_size, folder, saved)


def _load_into_another_split(rank, world_size, folder: str, saved) -> None:
    everyone: list = [None] * world_size
    torch.distributed.all_gather_object(everyone, saved)
    tp_rank = rank % 2  # dp-outer layout (pp, tp): the same TP rank holds the same shard
    union = {
        n: v for r, states in enumerate(everyone) if r % 2 == tp_rank for n, v in states.items()
    }
    parallel = ParallelConfig(pp=2, tp=2, num_microbatches=M, num_layers_per_stage=[2, 2])
    plugin, booster, model, optimizer, _ = _boost(HeteroConfig(parallel=parallel), 2, True)
    try:
        booster.load_optimizer(optimizer, f"{folder}/optimizer")
        loaded = _states(model, optimizer)
    finally:
        plugin.close()
    assert loaded and loaded.keys() <= union.keys(), sorted(loaded.keys() - union.keys())
    for name, tensors in loaded.items():
        for key, value in tensors.items():
            assert torch.equal(value, union[name][key]), f"{name}.{key} rank {rank} in [2, 2]"


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_pp_uneven_split_checkpoint_round_trip(tmp_path):
    run_distributed(_run, world_size=2, folder=str(tmp_path), tp=1)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(900)
def test_pp_uneven_tp_checkpoint_round_trip(tmp_path):
    run_distributed(_run, world_size=4, folder=str(tmp_path), tp=2)
