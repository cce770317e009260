"""The schedule figure: the panels it draws and the PNG it writes."""

from __future__ import annotations

from colossal_hetero.pipeline.plot import plot_schedules, simulate_panels


def test_panels_and_png(tmp_path):
    panels = simulate_panels((1, 2, 4))
    # Latency 1 on equal stages (f=1, b=2): grouped steps pay fill and drain only,
    # (m + p - 1)(f + b) + 2c(p - 1) = 11 * 3 + 2 * 3 = 39; 1F1B pays more.
    assert panels[2].step_time == panels[4].step_time == 39.0
    assert panels[1].step_time > 39.0
    assert [r.peak_in_flight for r in panels.values()] == [(4, 3, 2, 1), (8, 6, 4, 2), (8, 8, 8, 4)]
    out = tmp_path / "kfkb.png"
    plot_schedules(str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
