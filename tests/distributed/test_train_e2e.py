"""The YAML-launched trainer end to end: errors on every rank, falling loss, exact resume.

These launch ``python -m colossal_hetero.train`` through torchrun, as users do.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from colossal_hetero.cli import launch_command
from colossal_hetero.metrics import read_run
from tests.train_configs import FORWARD_RTOL, TINY_GPT2
from tests.train_configs import with_sections as _with


def _launch(
    config: dict, folder: Path, nproc: int, timeout: float = 300
) -> subprocess.CompletedProcess:
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    command = launch_command(path, nproc)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.dist
@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"parallel": {"tp_size": 2}}, "parallel.tp_size: unknown key (did you mean 'tp'?)"),
        ({"parallel": {"tp": 3, "pp": 1}}, "parallel: tp * pp = 3 * 1 = 3 does not divide"),
    ],
)
def test_config_errors_reach_every_rank_without_hang(tmp_path, sections, message):
    # The timeout only catches a hang: 300 s, as the other launches, holds on a loaded machine
    # (two ranks importing torch and Colossal-AI take over a minute when the cores are busy).
    result = _launch(_with(TINY_GPT2, **sections), tmp_path, nproc=2, timeout=300)
    assert result.returncode != 0
    for rank in (0, 1):
        assert f"[rank {rank}] colossal-hetero: config error: {message}" in result.stderr
    assert "Traceback" not in result.stderr.split("colossal-hetero: config error")[0]


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_train_tp2_pp2_loss_falls_and_resume_is_exact(tmp_path):
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    checkpoints = tmp_path / "checkpoints"
    full = _with(
        TINY_GPT2, logging={"dir": str(full_dir)}, checkpoint={"dir": str(checkpoints), "every": 4}
    )
    result = _launch(full, tmp_path, nproc=4)
    assert result.returncode == 0, result.stderr[-4000:]
    records = read_run(full_dir)
    val = [(r.step, r.val_loss) for r in records if r.val_loss is not None and r.rank == 0]
    assert [step for step, _ in val] == [3, 7]
    assert val[1][1] < val[0][1] - 0.1, f"validation loss did not fall: {val}"

    # Keep only the step-4 checkpoint and continue from it in a fresh run.
    (checkpoints / "step_8" / "trainer.json").unlink()
    resumed = _with(
        full,
        logging={"dir": str(resumed_dir)},
        checkpoint={"dir": str(checkpoints), "every": 0, "resume": True},
    )
    result = _launch(resumed, tmp_path, nproc=4)
    assert result.returncode == 0, result.stderr[-4000:]
    again = {(r.step, r.rank): r for r in read_run(resumed_dir)}
    assert min(step for step, _ in again) == 4
    for record in records:
        if record.step >= 4:
            twin = again[(record.step, record.rank)]
            # Bitwise: same weights, optimizer moments, learning rate and data position.
            assert twin.loss == record.loss, (record.step, record.rank, twin.loss, record.loss)
            assert twin.lr == record.lr
            assert twin.val_loss == record.val_loss


PLANNED_GPT2 = _with(
    TINY_GPT2,
    model={
        "arch": "gpt2",
        "hf": {
            "n_layer": 2,
            "n_embd": 48,
            "n_head": 6,
            "n_positions": 32,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    },
    parallel={"tp": 2, "pp": 1, "num_microbatches": 1},
    cluster={"device": "cpu", "devices": [{"speed": 1.0}, {"speed": 0.25}]},
    emulation={"compute": [{"rank": 1, "factor": 4.0}]},
    plan={"mode": "auto", "reference_tflops": 0.005},
)


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_planned_uneven_tp_trains_and_resumes_into_even_widths(tmp_path):
    run_dir, resumed_dir, checkpoints = tmp_path / "run", tmp_path / "even", tmp_path / "ckpt"
    planned = _with(
        PLANNED_GPT2,
        logging={"dir": str(run_dir)},
        checkpoint={"dir": str(checkpoints), "every": 4},
    )
    result = _launch(planned, tmp_path, nproc=2)
    assert result.returncode == 0, result.stderr[-4000:]
    plan = yaml.safe_load((run_dir / "plan.yaml").read_text())
    heads = plan["widths"]["heads"]
    assert sum(heads) == 6 and heads[0] > heads[1], heads  # the slow rank holds fewer heads
    records = read_run(run_dir)
    val = [r.val_loss for r in records if r.val_loss is not None and r.rank == 0]
    assert val[1] < val[0] - 0.1, val

    # Continue from step 4 with Colossal-AI's even split: the checkpoint re-shards.
    (checkpoints / "step_8" / "trainer.json").unlink()
    even = _with(
        planned,
        logging={"dir": str(resumed_dir)},
        plan={"mode": "even"},
        checkpoint={"dir": str(checkpoints), "every": 0, "resume": True},
    )
    result = _launch(even, tmp_path, nproc=2)
    assert result.returncode == 0, result.stderr[-4000:]
    again = {(r.step, r.rank): r for r in read_run(resumed_dir)}
    for record in records:
        if record.step == 4:
            twin = again[(record.step, record.rank)]
            # The weights re-shard exactly; the even widths sum in another order.
            assert abs(twin.loss - record.loss) <= FORWARD_RTOL * record.loss, record.rank

    # And into another TP size: one unsharded rank (tp 1) continues the same training.
    (checkpoints / "step_8" / "trainer.json").unlink(missing_ok=True)  # the even run's final
    single_dir = tmp_path / "single"
    single = _with(
        even,
        logging={"dir": str(single_dir)},
        parallel={"tp": 1},
        cluster={"device": "cpu", "devices": []},
        emulation={"compute": []},
    )
    result = _launch(single, tmp_path, nproc=1)
    assert result.returncode == 0, result.stderr[-4000:]
    alone = {r.step: r for r in read_run(single_dir)}
    for record in records:
        if record.step == 4 and record.rank == 0:
            # Same weights without the TP split: equal up to float summation order.
            assert abs(alone[4].loss - record.loss) <= FORWARD_RTOL * record.loss
