"""pipeline/profile.py: link time from per-message timestamps, the profile of a measured step,
and the simulator's prediction of it.

The oracle for the estimator is the simulator itself: a simulated step is turned into the
records its ranks would have measured (a sender notes when each pass ended, a receiver the
arrival of each message it had to wait for, and posts each receive when the message before it
has landed, as the simulator's first-in first-out link lets it move), and the profile read back
from those records must give the transfer time the step was simulated with, and predict the
same step time.
"""

from __future__ import annotations

import random

import pytest

from colossal_hetero.pipeline.profile import (
    NOT_BLOCKED,
    RankRecord,
    direction_seconds,
    predict_from_records,
    profile_from_records,
    record_from_vector,
    vector_width,
)
from colossal_hetero.pipeline.simulator import Trace, simulate


def test_direction_seconds_by_hand():
    # Message 0 waited on: 1.5 s from its send. Message 1 could move only once its receive was
    # posted, at 1.5: 2.5 - 1.5. Message 2's wait did not block: no sample. Median of 1.5, 1.
    sent, posted = [0.0, 1.0, 2.0], [0.0, 1.5, 2.6]
    assert direction_seconds(sent, posted, [1.5, 2.5, NOT_BLOCKED]) == 1.25
    assert direction_seconds(sent, posted, [NOT_BLOCKED] * 3) == 0.0  # hidden transfers
    assert direction_seconds([], [], []) == 0.0


def _records_from_simulation(f, b, c, m, k):
    """The records each stage of a simulated step would measure (one rank per stage)."""
    p = len(f)
    result = simulate(f, b, [Trace.constant(x) for x in c], m, k)
    sent = {(s, op): [0.0] * m for s in range(p) for op in "FB"}
    arrived = {(s, op): [NOT_BLOCKED] * m for s in range(p) for op in "FB"}
    for s in range(p):
        free = 0.0
        for e in (e for e in result.events if e.stage == s):
            needs_input = (e.op == "F" and s > 0) or (e.op == "B" and s < p - 1)
            if needs_input and e.start > free + 1e-12:  # idle until the input landed
                arrived[(s, e.op)][e.mb] = e.start
            sent[(s, e.op)][e.mb] = e.end
            free = e.end
    posted = {}  # (receiving stage, op) -> when each receive was posted: the last landing
    for link in range(p - 1):
        for op, src, dst in (("F", link, link + 1), ("B", link + 1, link)):
            landed = 0.0
            posted[(dst, op)] = []
            for t in sent[(src, op)]:
                posted[(dst, op)].append(landed)
                landed = max(t, landed) + c[link]
    return [
        RankRecord(
            rank=s,
            stage=s,
            next_rank=s + 1 if s < p - 1 else None,
            forward_s=f[s],
            backward_s=b[s],
            step_s=result.step_time,
            activation_bytes=100.0,
            message_bytes=10.0,
            sent_next=tuple(sent[(s, "F")]) if s < p - 1 else (),
            arrived_prev=tuple(arrived[(s, "F")]) if s > 0 else (),
            posted_prev=tuple(posted[(s, "F")]) if s > 0 else (),
            sent_prev=tuple(sent[(s, "B")]) if s > 0 else (),
            arrived_next=tuple(arrived[(s, "B")]) if s < p - 1 else (),
            posted_next=tuple(posted[(s, "B")]) if s < p - 1 else (),
        )
        for s in range(p)
    ], result.step_time


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_link_time_and_step_recovered_from_simulated_timestamps(p, m):
    rng = random.Random(p * 100 + m)
    exact = 0
    for _ in range(20):
        f = [rng.uniform(0.5, 1.5) for _ in range(p)]
        b = [2 * x for x in f]
        c = [rng.choice([0.0, rng.uniform(0.1, 3.0)]) for _ in range(p - 1)]
        for k in (1, 2, m):
            records, step = _records_from_simulation(f, b, c, m, k)
            profile = profile_from_records(records, p)
            for got, want in zip(profile.transfer_s, c, strict=True):
                # A transfer hidden behind compute on both ends leaves no blocked receive: then
                # it did not delay anyone and reads as free. Else it reads exactly.
                assert got == pytest.approx(want, abs=1e-9) or got == 0.0, (f, c, k)
                exact += want > 0 and got == pytest.approx(want, abs=1e-9)
            prediction = predict_from_records(records, m, k)
            assert prediction.predicted_s == pytest.approx(step, rel=1e-9), (f, c, k)
            assert prediction.relative_error < 1e-9
            # Any order of the gathered records, and records as JSON dicts, give the same.
            shuffled = [r.to_dict() for r in rng.sample(records, len(records))]
            assert predict_from_records(shuffled, m, k).predicted_s == prediction.predicted_s
    assert exact >= 20  # most slow links were read, not just called free


def test_slow_link_reads_exactly_and_grows():
    # A link slower than the compute always makes the receiver wait: read exactly.
    seen = []
    for c in (1.5, 3.0, 6.0):
        records, _ = _records_from_simulation([1.0, 1.0], [2.0, 2.0], [c], 4, 1)
        seen.append(profile_from_records(records, 2).transfer_s[0])
    assert seen == pytest.approx([1.5, 3.0, 6.0], abs=1e-9)


def test_vector_round_trip_and_errors():
    record = RankRecord(3, 1, 5, 0.5, 1.0, 9.0, 64.0, 8.0, (1.0, 2.0), (1.5, NOT_BLOCKED), (0.5,))
    m = 4
    vector = record.to_vector(m)
    assert len(vector) == vector_width(m)
    back = record_from_vector(vector, m)
    assert back.sent_next == record.sent_next and back.sent_prev == ()
    assert back.posted_prev == (0.5,) and back.posted_next == ()
    assert back.arrived_prev == (1.5, NOT_BLOCKED, NOT_BLOCKED, NOT_BLOCKED)
    assert (back.rank, back.stage, back.next_rank, back.step_s) == (3, 1, 5, 9.0)
    assert (
        record_from_vector(RankRecord(0, 1, None, 1, 1, 1, 1, 0).to_vector(m), m).next_rank is None
    )
    with pytest.raises(ValueError, match="num_microbatches"):
        record.to_vector(1)
    with pytest.raises(ValueError, match="record vector"):
        record_from_vector(vector[:-1], m)
    with pytest.raises(ValueError, match="every stage"):
        profile_from_records([record], 2)
