"""configs/gpt2_tp2d.yaml through the YAML trainer on 4 ranks (torchrun), as users run it.

Slow (four processes importing torch and Colossal-AI, then SUMMA's many small collectives):
the shipped config trains with falling validation loss, and its final checkpoint is a
Hugging Face folder that plain ``transformers`` loads.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from transformers import GPT2LMHeadModel

from colossal_hetero.metrics import read_run
from tests.distributed.test_train_e2e import _launch

CONFIG = "configs/gpt2_tp2d.yaml"


@pytest.mark.slow
def test_shipped_2d_config_trains_and_checkpoints_for_transformers(tmp_path):
    with open(CONFIG) as handle:
        config = yaml.safe_load(handle)
    config["train"] = {"steps": 16, "eval_every": 8, "eval_batches": 2}
    config["logging"] = {"dir": str(tmp_path / "run"), "progress": False, "plot": False}
    config["checkpoint"] = {"dir": str(tmp_path / "ckpt"), "every": 16}
    result = _launch(config, tmp_path, nproc=4, timeout=1500)
    assert result.returncode == 0, result.stderr[-4000:]
    records = read_run(tmp_path / "run")
    val = [(r.step, r.val_loss) for r in records if r.val_loss is not None and r.rank == 0]
    assert [step for step, _ in val] == [7, 15]
    assert val[1][1] < val[0][1] - 0.1, f"validation loss did not fall: {val}"
    losses = {r.loss for r in records if r.step == 15}
    assert len(losses) == 1  # every rank of the mesh reports the same loss
    folders = sorted((tmp_path / "ckpt").glob("*/model"))
    assert folders, list((tmp_path / "ckpt").rglob("*"))
    model = GPT2LMHeadModel.from_pretrained(folders[-1])
    assert model.transformer.wte.weight.shape == (256, 128)
    assert torch.isfinite(model.transformer.h[0].attn.c_attn.weight).all()
