"""Checkpoints through Colossal-AI's checkpoint IO, plus the trainer's own position.

Layout of ``<dir>/step_<N>/``: ``model/`` (sharded, gathered to the full HF parameter names),
``optimizer/`` (sharded), ``lr_scheduler.pt``, with ``moe.replace_every`` also
``moe_placement.pt`` (the experts' placement and the loads counted since the last decision, so
a resumed run places as the uninterrupted one would), and ``trainer.json`` written last, so a
folder without ``trainer.json`` is an interrupted save and is ignored on resume.

Expert-parallel runs (``parallel.ep > 1``) save through checkpoint/moe.py: tensors by their
Hugging Face names, whatever the placement, so a checkpoint loads under any placement.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from colossalai.booster import Booster

_STEP_DIR = re.compile(r"^step_(\d+)$")
_REPLACER_FILE = "moe_placement.pt"


def save_checkpoint(
    booster: Booster, folder: str | Path, step: int, model: Any, optimizer: Any, lr_scheduler: Any
) -> Path:
    """Save everything needed to continue after ``step`` (all ranks must call it)."""
    target = Path(folder) / f"step_{step}"
    booster.save_model(model, str(target / "model"), shard=True)
    booster.save_optimizer(optimizer, str(target / "optimizer"), shard=True)
    booster.save_lr_scheduler(lr_scheduler, str(target / "lr_scheduler.pt"))
    replacer = getattr(booster.plugin, "moe_replacer", None)
    if replacer is not None:  # moe.replace_every: the placement in use and the loads so far
        state = replacer.state()
        if dist.get_rank() == 0:
            torch.save(state, target / _REPLACER_FILE)
    dist.barrier()
    if dist.get_rank() == 0:
        (target / "trainer.json").write_text(json.dumps({"step": step}))
    dist.barrier()
    return target


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest complete checkpoint under ``folder``, or None."""
    root = Path(folder)
    if not root.is_dir():
        return None
    complete = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _STEP_DIR.match(path.name)) and (path / "trainer.json").exists()
    ]
    return max(complete)[1] if complete else None


def load_checkpoint(
    booster: Booster, path: str | Path, model: Any, optimizer: Any, lr_scheduler: Any
) -> int:
    """Restore a checkpoint saved by ``save_checkpoint``; returns the step it was taken after."""
    source = Path(path)
    booster.load_model(model, str(source / "model"))
    booster.load_optimizer(optimizer, str(source / "optimizer"))
    booster.load_lr_scheduler(lr_scheduler, str(source / "lr_scheduler.pt"))
    replacer = getattr(booster.plugin, "moe_replacer", None)
    if replacer is not None and (source / _REPLACER_FILE).is_file():
        replacer.restore(torch.load(source / _REPLACER_FILE, weights_only=False))
    return int(json.loads((source / "trainer.json").read_text())["step"])
