"""colossal_hetero.metrics: JSONL round trip, per-rank files, summary medians, plot, progress."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from colossal_hetero.metrics import (
    MetricsWriter,
    StepRecord,
    TrainingProgress,
    format_status,
    plot_run,
    rank_metrics_path,
    read_metrics,
    read_run,
    summarize,
)


def _record(step, rank, step_time=1.0, compute_time=0.5, comm_wait=0.25, loss=None, **extra):
    return StepRecord(
        step=step,
        rank=rank,
        step_time=step_time,
        compute_time=compute_time,
        comm_wait=comm_wait,
        loss=loss,
        **extra,
    )


def test_json_round_trip_is_exact():
    full = _record(
        3,
        1,
        step_time=0.1 + 0.2,
        compute_time=1 / 3,
        comm_wait=1e-9,
        loss=2.718281828459045,
        stretch_time=0.05,
        network_delay=0.01,
        lr=3e-4,
        val_loss=2.5,
        val_accuracy=0.875,
        tokens_per_second=12345.678,
        samples_per_second=42.0,
    )
    bare = _record(0, 0)
    for record in (full, bare):
        assert StepRecord.from_json(record.to_json()) == record
    assert json.loads(bare.to_json()) == {
        "step": 0,
        "rank": 0,
        "step_time": 1.0,
        "compute_time": 0.5,
        "comm_wait": 0.25,
        "loss": None,
    }


def test_from_json_rejects_bad_lines():
    for line in (
        '{"step":0,"rank":0,"step_time":1,"compute_time":1,"comm_wait":0}',  # no loss
        '{"step":0,"rank":0,"step_time":1,"compute_time":1,"comm_wait":0,"loss":1,"x":1}',
        '{"step":0.5,"rank":0,"step_time":1,"compute_time":1,"comm_wait":0,"loss":1}',
        '{"step":0,"rank":0,"step_time":-1,"compute_time":1,"comm_wait":0,"loss":1}',
        "[1, 2]",
    ):
        with pytest.raises(ValueError):
            StepRecord.from_json(line)


def test_writer_appends_and_reader_reads(tmp_path):
    path = rank_metrics_path(tmp_path / "run", 2)
    assert path.name == "metrics_rank2.jsonl"
    records = [_record(s, 2, loss=float(s)) for s in range(3)]
    with MetricsWriter(path) as writer:
        writer.write(records[0])
        writer.write(records[1])
    assert writer.closed
    with MetricsWriter(path) as writer:  # a resumed run appends
        writer.write(records[2])
    assert read_metrics(path) == records
    assert read_metrics([path, path]) == records + records
    path.write_text(path.read_text() + "not json\n")
    with pytest.raises(ValueError, match=r"metrics_rank2.jsonl:4"):
        read_metrics(path)


def test_read_run_merges_ranks_and_keeps_latest(tmp_path):
    for rank in (1, 0):
        with MetricsWriter(rank_metrics_path(tmp_path, rank)) as writer:
            for step in (0, 1, 2):
                writer.write(_record(step, rank, step_time=1.0 + rank))
            writer.write(_record(2, rank, step_time=9.0))  # step 2 again after a resume
    (tmp_path / "notes.txt").write_text("ignored")
    records = read_run(tmp_path)
    assert [(r.step, r.rank) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [r.step_time for r in records[-2:]] == [9.0, 9.0]


def test_read_run_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_run(tmp_path)
    with MetricsWriter(rank_metrics_path(tmp_path, 0)) as writer:
        writer.write(_record(0, 1))
    with pytest.raises(ValueError):
        read_run(tmp_path)


def test_summarize_medians_by_hand():
    # step times, rank 0: 9 (warm-up), 1, 2, 4; rank 1: 9 (warm-up), 3, 1, 5
    times = [(9.0, 9.0), (1.0, 3.0), (2.0, 1.0), (4.0, 5.0)]
    val = {(2, 0): {"val_loss": 7.0}, (3, 1): {"val_loss": 6.0, "val_accuracy": 0.5}}
    records = []
    for step, (t0, t1) in enumerate(times):
        loss = 4.0 - step if step < 3 else None  # the last step's loss is on rank 1 only
        records.append(
            _record(step, 0, step_time=t0, compute_time=t0 / 2, loss=loss, **val.get((step, 0), {}))
        )
        records.append(
            _record(
                step, 1, step_time=t1, comm_wait=step, loss=4.0 - step, **val.get((step, 1), {})
            )
        )
    summary = summarize(records, warmup=1)
    assert summary["num_steps"] == 4 and summary["warmup"] == 1
    assert summary["ranks"][0] == {
        "step_time": 2.0,  # median(1, 2, 4)
        "compute_time": 1.0,  # median(0.5, 1, 2)
        "comm_wait": 0.25,
        "num_steps": 3,
    }
    assert summary["ranks"][1] == {
        "step_time": 3.0,  # median(3, 1, 5)
        "compute_time": 0.5,
        "comm_wait": 2.0,  # median(1, 2, 3)
        "num_steps": 3,
    }
    # slowest rank per step: step 1 -> 3, step 2 -> 2, step 3 -> 5; median 3
    assert summary["median_step_time"] == 3.0
    assert summary["last_train_loss"] == 1.0
    assert summary["last_val_loss"] == 6.0
    assert summary["last_val_accuracy"] == 0.5
    assert summarize(records, warmup=0)["ranks"][0]["step_time"] == 3.0  # median(9, 1, 2, 4)
    json.dumps(summary)


def test_summarize_keeps_one_step_when_warmup_covers_all():
    summary = summarize([_record(0, 0, step_time=2.0)], warmup=5)
    assert summary["warmup"] == 0 and summary["median_step_time"] == 2.0
    assert summary["last_train_loss"] is None
    with pytest.raises(ValueError):
        summarize([])


def test_plot_run_writes_png(tmp_path):
    records = [
        _record(s, r, step_time=1.0 + r, compute_time=0.5 + r, loss=5.0 / (s + 1) if r else None)
        for s in range(10)
        for r in range(2)
    ]
    records.append(_record(9, 1, val_loss=1.0))
    out = plot_run(records, tmp_path / "sub" / "plot.png", title="test run")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 1000
    with pytest.raises(ValueError):
        plot_run([], tmp_path / "empty.png")


def test_progress_enabled_and_disabled():
    buffer = io.StringIO()
    with TrainingProgress(5, enabled=True, console=Console(file=buffer, width=150)) as progress:
        for step in range(5):
            progress.update(step, 2.0 - step / 10, 0.25, rank_step_times=[0.2, 0.25])
        progress.log("validation loss 1.5")
    text = buffer.getvalue()
    assert "5/5" in text and "validation loss 1.5" in text and "0.25" in text
    with TrainingProgress(5, enabled=False) as progress:
        progress.update(0, None, 0.1)
        progress.log("nothing")
    with pytest.raises(ValueError):
        TrainingProgress(0)


def test_format_status():
    status = format_status(1.23456, 0.5, [0.4, 0.5], {"lr": 0.001})
    assert status == "loss 1.2346 | 0.500 s/step | ranks 0.40 0.50 | lr=0.001"
    assert format_status(None, 0.5).startswith("loss -")
