"""Per-kind communication fields in the JSONL records and the rank summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colossal_hetero.metrics import MetricsWriter, StepRecord, read_metrics, summarize

KINDS = ("all_reduce", "all_to_all", "p2p", "other")


def _record(step: int, rank: int, by_kind: bool = True, **extra: object) -> StepRecord:
    fields: dict[str, object] = {}
    if by_kind:
        fields["bytes_by_kind"] = dict(zip(KINDS, (4000 * (step + 1), 2400, 900, 0), strict=True))
        fields["wait_by_kind"] = dict(zip(KINDS, (0.5 * (step + 1), 0.25, 0.125, 0.0), strict=True))
    fields.update(extra)
    return StepRecord(
        step=step, rank=rank, step_time=2.0, compute_time=1.0, comm_wait=1.0, loss=None, **fields
    )


def test_per_kind_fields_round_trip_with_their_types() -> None:
    record = _record(2, 1)
    line = record.to_json()
    data = json.loads(line)
    assert data["bytes_by_kind"] == {
        "all_reduce": 12000,
        "all_to_all": 2400,
        "p2p": 900,
        "other": 0,
    }
    assert StepRecord.from_json(line) == record
    parsed = StepRecord.from_json(line)
    assert parsed.bytes_by_kind is not None and parsed.wait_by_kind is not None
    assert all(type(v) is int for v in parsed.bytes_by_kind.values())
    assert all(type(v) is float for v in parsed.wait_by_kind.values())  # "other": 0.0 stays float


def test_lines_written_before_the_fields_existed_still_parse(tmp_path: Path) -> None:
    old = '{"step":0,"rank":0,"step_time":1.0,"compute_time":0.5,"comm_wait":0.5,"loss":null}'
    path = tmp_path / "metrics_rank0.jsonl"
    path.write_text(old + "\n")
    with MetricsWriter(path) as writer:
        writer.write(_record(1, 0))
    old_record, new_record = read_metrics(path)
    assert old_record.bytes_by_kind is None and old_record.wait_by_kind is None
    assert new_record == _record(1, 0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("bytes_by_kind", [1, 2]),
        ("bytes_by_kind", {"p2p": 1.5}),  # bytes are whole
        ("bytes_by_kind", {"p2p": -1}),
        ("wait_by_kind", {"p2p": "0.1"}),
        ("wait_by_kind", {"p2p": True}),
    ],
)
def test_bad_per_kind_values_are_refused(field: str, value: object) -> None:
    data = json.loads(_record(0, 0, by_kind=False).to_json())
    data[field] = value
    with pytest.raises(ValueError, match=field):
        StepRecord.from_json(json.dumps(data))


def test_summary_takes_per_kind_medians_after_warmup_and_skips_old_ranks() -> None:
    # Rank 0 records steps 0..3 (step 0 is warm-up); rank 1 wrote an old file without the fields.
    records = [_record(s, 0) for s in range(4)] + [_record(s, 1, by_kind=False) for s in range(4)]
    ranks = summarize(records, warmup=1)["ranks"]
    # Steps 1, 2, 3: all-reduce bytes 8000, 12000, 16000 and waits 1.0, 1.5, 2.0 -> medians.
    assert ranks[0]["bytes_by_kind"] == {
        "all_reduce": 12000,
        "all_to_all": 2400,
        "p2p": 900,
        "other": 0,
    }
    assert ranks[0]["wait_by_kind"] == {
        "all_reduce": 1.5,
        "all_to_all": 0.25,
        "p2p": 0.125,
        "other": 0,
    }
    assert "bytes_by_kind" not in ranks[1] and "wait_by_kind" not in ranks[1]


def test_a_kind_missing_from_some_records_counts_zero_there() -> None:
    records = [
        _record(1, 0, by_kind=False, wait_by_kind={"p2p": 0.5}),
        _record(2, 0, by_kind=False, wait_by_kind={"p2p": 0.25, "all_reduce": 1.0}),
        _record(3, 0, by_kind=False, wait_by_kind={"p2p": 0.75, "all_reduce": 3.0}),
    ]
    waits = summarize(records, warmup=0)["ranks"][0]["wait_by_kind"]
    assert waits == {"all_reduce": 1.0, "p2p": 0.5}  # medians of (0, 1, 3) and (0.5, 0.25, 0.75)
