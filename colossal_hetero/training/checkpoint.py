"""Checkpoints through Colossal-AI's checkpoint IO, plus the trainer's own position.

Layout of ``<dir>/step_<N>/``: ``model/`` (sharded, gathered to the full HF parameter names),
``optimizer/`` (sharded), ``lr_scheduler.pt``, and ``trainer.json`` written last, so a folder
without ``trainer.json`` is an interrupted save and is ignored on resume.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch.distributed as dist
from colossalai.booster import Booster

_STEP_DIR = re.compile(r"^step_(\d+)$")


def save_checkpoint(
    booster: Booster, folder: str | Path, step: int, model: Any, optimizer: Any, lr_scheduler: Any
) -> Path:
    """Save everything needed to continue after ``step`` (all ranks must call it)."""
    target = Path(folder) / f"step_{step}"
    booster.save_model(model, str(target / "model"), shard=True)
    booster.save_optimizer(optimizer, str(target / "optimizer"), shard=True)
    booster.save_lr_scheduler(lr_scheduler, str(target / "lr_scheduler.pt"))
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
    return int(json.loads((source / "trainer.json").read_text())["step"])
