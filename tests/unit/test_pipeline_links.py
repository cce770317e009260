"""pipeline/links.py: a download's throughput bounds the times per message into it.

Oracles: window arithmetic by hand, and one step measured on shaped links (PP=4, k = 1, a
tenant on rank 2's download; ``pipeline_records/pp4_tenant_k1.json``) whose old reading put
20-27 ms per message on both directions into rank 2 and over-predicted the step by 30%.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from colossal_hetero.pipeline.links import (
    _Download,
    _downloads,
    _messages,
    _port_scale,
    _PortLandings,
    _scaled,
    _unseen_by_port,
    link_seconds,
)
from colossal_hetero.pipeline.profile import RankRecord, predict_from_records
from tests.unit.test_pipeline_profile import _records_from_simulation

RECORDED = Path(__file__).resolve().parent / "pipeline_records" / "pp4_tenant_k1.json"
F, B = ("F", 1, 1), ("B", 2, 2)


def test_port_scale_by_hand():
    # Seven arrivals 10 ms apart, kinds alternating. Runs over half of them span 3 gaps
    # (30 ms) and hold 3 landings; at 20 ms per message they would need 60 ms: scale 0.5.
    landed = [(0.01 * i, F if i % 2 == 0 else B) for i in range(7)]
    download: _Download = (landed, [])
    assert _port_scale(download, {F: 0.02, B: 0.02}) == pytest.approx(0.5)
    # A message found landed inside the first run counts too: 4 messages in 30 ms.
    found: _Download = (landed, [(F, (0.011, 0.019))])
    assert _port_scale(found, {F: 0.02, B: 0.02}) == pytest.approx(0.03 / 0.08)
    # Only one kind is slow: the runs hold 2 F + 1 B or 1 F + 2 B (40 or 20 ms at F 20 ms,
    # B free); the first exceeds its 30 ms.
    assert _port_scale(download, {F: 0.02, B: 0.0}) == pytest.approx(0.03 / 0.04)
    # Times that fit, or too few arrivals: no change.
    assert _port_scale(download, {F: 0.01, B: 0.01}) == 1.0
    assert _port_scale((landed[:4], []), {F: 0.02, B: 0.02}) == 1.0


def test_scaled_keeps_a_lone_message_delay():
    # 20 ms per message and 5 ms latency at half the time per message: without token debt a
    # lone message took 25 ms, still does (10 + 15); under debt its delay is the latency alone.
    assert _scaled((0.02, 0.005), 0.5, debt=False) == pytest.approx((0.01, 0.015))
    assert _scaled((0.02, 0.005), 0.5, debt=True) == pytest.approx((0.01, 0.005))
    assert _scaled((0.02, 0.005), 1.0, debt=False) == (0.02, 0.005)


def _recorded() -> tuple[list[RankRecord], dict]:
    data = json.loads(RECORDED.read_text())
    return [RankRecord.from_dict(r) for r in data["records"]], data


def test_recorded_tenant_step_fits_rank_2_download():
    records, data = _recorded()
    links = link_seconds(records, 4)
    # Both kinds into rank 2 (activations over boundary 1, gradients over boundary 2) fit the
    # time its download took for them over every run of half its arrivals.
    messages = _messages(records)
    download = _downloads(messages, _unseen_by_port(messages))[2]
    seconds = {F: links["F"][1], B: links["B"][2]}
    assert _port_scale(download, seconds) == pytest.approx(1.0)
    # The old reading: 25.3 / 25.8 ms per message, which the download could not have carried
    # (both kinds took ~16 ms each there). The step's links run in token debt, so the
    # latencies stay as read (a lone activation 19 ms, from its one lone sample).
    assert max(seconds.values()) < 0.017
    assert links["D"] == (1.0, 1.0, 1.0)
    assert links["LF"][1] == pytest.approx(0.0193, abs=1e-4)
    # The simulated step: 0.655 s against 0.704 s measured (the old reading: 0.912 s).
    prediction = predict_from_records(records, data["num_microbatches"], data["k"])
    assert prediction.measured_s == pytest.approx(0.704, abs=5e-4)
    assert prediction.relative_error < 0.1


@pytest.mark.parametrize("p,m", [(3, 8), (4, 16)])
def test_times_of_a_simulated_shared_port_always_fit_its_downloads(p, m):
    # The bound's premise, with the simulator as the oracle: on shared stage ports each
    # download lands one message at least its time per message after the one before, so the
    # step's true times fit every run of arrivals a receiver saw (latency and first messages
    # included), whatever the compute, links and k.
    rng = random.Random(p * 1000 + m)
    for _ in range(15):
        f = [rng.uniform(0.5, 1.5) for _ in range(p)]
        b = [2 * x for x in f]
        c = [rng.choice([0.1, rng.uniform(0.1, 3.0)]) for _ in range(p - 1)]
        latency = rng.choice([0.0, rng.uniform(0.0, 2.0)])
        for k in (1, 2, m // 2):
            records, _ = _records_from_simulation(f, b, c, m, k, 0.5, latency, shared=True)
            messages = _messages(records)
            true = {(op, s, s): c[s] for op in "FB" for s in range(p - 1)}
            for download in _downloads(messages, _unseen_by_port(messages)).values():
                assert _port_scale(download, true) == 1.0, (f, c, k, latency)


def test_port_landings_count_other_kinds_as_brute_force():
    # Random landings of three kinds on two ports, and messages found landed (spans): the
    # bisection count equals counting each landing and span by hand, for every pair of bounds
    # (including bounds equal to a landing, and reversed ones, which count nothing).
    rng = random.Random(11)
    kinds = [("F", 0, 0), ("B", 0, 0), ("F", 1, 1)]
    ports = [("up", 1), ("down", 2)]
    spans: dict = {}
    for port in ports:
        for _ in range(12):
            lo = round(rng.uniform(0, 10), 1)
            spans.setdefault(port, []).append((rng.choice(kinds), (lo, lo + rng.uniform(0.1, 2))))
    log = _PortLandings(spans)
    landed: list = []
    for _ in range(40):
        port, t, kind = rng.choice(ports), round(rng.uniform(0, 10), 1), rng.choice(kinds)
        log.add(port, t, kind)
        landed.append((port, t, kind))
    bounds = sorted({t for _, t, _ in landed} | {0.0, 5.05, 10.0})

    def by_hand(port, kind, after, before):
        landings = sum(1 for q, t, k in landed if q == port and k != kind and after < t < before)
        found = sum(1 for k, (lo, hi) in spans[port] if k != kind and after < lo and hi < before)
        return landings + found

    for kind in kinds:
        for after in bounds:
            for before in bounds:
                want = max([0] + [by_hand(port, kind, after, before) for port in ports])
                assert log.busiest(ports, kind, after, before) == want, (kind, after, before)
