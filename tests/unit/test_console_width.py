"""The trainer's console output fits an 80-column terminal, losing nothing."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from colossal_hetero.metrics import TrainingProgress
from colossal_hetero.planner.resolve import unplanned_notice
from colossal_hetero.train import format_results, wrap

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _fits(text: str) -> None:
    assert all(len(line) <= 80 for line in text.splitlines()), text


def test_final_summary_wraps_at_80_columns_and_keeps_every_point():
    losses = [(step, 10.0 / (step + 1)) for step in range(4, 200, 5)]  # 40 evaluations
    text = format_results(losses, 0.875)
    _fits(text)
    assert len(text.splitlines()) > 2  # one line would be about 500 columns
    flat = " ".join(text.split())
    for step, loss in losses:
        assert f"{step + 1}: {loss:.4f}" in flat
    assert text.endswith("validation accuracy: 0.875")


def test_notice_wraps_at_80_columns():
    import dataclasses

    from colossal_hetero.config import load_config
    from colossal_hetero.config.schema import DeviceSpec

    config = load_config(CONFIGS / "gpt2_tp2_pp2.yaml")
    devices = [DeviceSpec(speed=s) for s in (1.0, 1.0, 0.5, 0.5)]
    hetero = dataclasses.replace(
        config, cluster=dataclasses.replace(config.cluster, devices=devices)
    )
    notice = unplanned_notice(hetero.plugin_config())
    assert notice is not None and len(notice) > 80
    text = wrap(f"colossal-hetero: {notice}")
    _fits(text)
    assert " ".join(text.split()) == f"colossal-hetero: {notice}"


def test_progress_status_with_sixteen_ranks_wraps_at_80_columns():
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=False, color_system=None)
    times = [0.2 + 0.01 * r for r in range(16)]  # the status alone is about 120 columns
    with TrainingProgress(100, console=console) as bar:
        for step in range(100):
            bar.update(step, 2.3456, 0.35, times)
        bar.log("step 100: validation loss 2.3456, accuracy 0.875")
    text = out.getvalue()
    _fits(text)
    flat = " ".join(text.split())
    assert "100/100" in flat and "ranks " + " ".join(f"{t:.2f}" for t in times) in flat
