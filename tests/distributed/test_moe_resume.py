"""The trainer resumes an expert-parallel run exactly (checkpoint.dir, resume), on gloo ranks.

EP=2 x DP=2 on 4 ranks, a tiny Mixtral in fp32 with AdamW, speed-aware re-placement every 2
steps on ep speeds [1, 0.5] (so experts move after step 1), checkpoints every 3 steps:

- the uninterrupted run trains 6 steps; its step-3 checkpoint was saved under a moved
  placement with step 2's router loads counted but not yet used;
- a fresh run resumes from it (the step-6 checkpoint hidden): it starts from the config's even
  placement, loads the weights and AdamW state by name, moves the experts back to the saved
  placement and takes over the saved loads.
Checks: every resumed step's loss (every rank) and learning rate equal the uninterrupted run's
bit for bit, and the re-placement decisions after the resume (loads, placements) are the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.unit.test_moe_config import HF as MIXTRAL_HF

HF = {**MIXTRAL_HF, "router_aux_loss_coef": 0.02}
STEPS, EVERY = 6, 3


def _config(folder: Path, name: str, resume: bool) -> dict:
    return {
        "model": {"arch": "mixtral", "hf": HF},
        "data": {"dataset": "pydoc_topics", "seq_len": 16, "global_batch_size": 8},
        "parallel": {"ep": 2},
        "moe": {"chunk_kib": 1, "replace_every": 2},
        "cluster": {"device": "cpu", "devices": [{"speed": s} for s in (1.0, 0.5, 1.0, 0.5)]},
        "plan": {"mode": "even"},
        "optimizer": {"name": "adamw", "lr": 0.01},
        "train": {"steps": STEPS, "eval_every": 0},
        "logging": {"dir": str(folder / name), "progress": False, "plot": False},
        "checkpoint": {
            "dir": str(folder / "ckpt"),
            "every": 0 if resume else EVERY,
            "resume": resume,
        },
    }


def _decisions(folder: Path, rank: int) -> dict[int, list]:
    lines = (folder / f"moe_placement_rank{rank}.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: [(x["loads"], x["placement"]) for x in r["layers"]] for r in records}


def _check(rank: int, world_size: int, device: torch.device, folder: str) -> None:
    from colossal_hetero.config.loader import from_dict
    from colossal_hetero.config.schema import RunConfig
    from colossal_hetero.metrics import read_run
    from colossal_hetero.training.trainer import run_training

    root = Path(folder)
    full = from_dict(RunConfig, _config(root, "full", resume=False))
    run_training(full, device)
    if rank == 0:
        (root / "ckpt" / f"step_{STEPS}" / "trainer.json").unlink()
    dist.barrier()
    resumed = from_dict(RunConfig, _config(root, "resumed", resume=True))
    run_training(resumed, device)
    dist.barrier()
    before = _decisions(root / "full", rank)
    assert any(moved for _, moved in before[1]), before  # a move before the checkpoint
    assert before[1][0][1] != [[0, 1], [2, 3]] or before[1][1][1] != [[0, 1], [2, 3]], before
    again = _decisions(root / "resumed", rank)
    assert sorted(again) == [3, 5] and all(again[s] == before[s] for s in again), (again, before)
    records = {(r.step, r.rank): r for r in read_run(root / "full")}
    twins = {(r.step, r.rank): r for r in read_run(root / "resumed")}
    assert min(step for step, _ in twins) == EVERY
    for key, twin in twins.items():
        assert twin.loss == records[key].loss, (key, twin.loss, records[key].loss)
        assert twin.lr == records[key].lr, key


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_resumes_an_ep_run_exactly(tmp_path: Path) -> None:
    run_distributed(_check, 4, force_cpu=True, folder=str(tmp_path))
