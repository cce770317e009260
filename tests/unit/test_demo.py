"""The demo's table and plot from hand-made figures (no spawn): the columns hold what the rows
say, the table fits 80 columns, and the plot is written."""

from __future__ import annotations

from rich.console import Console

from colossal_hetero.demo import _median_step, _per_rank, comparison_table, plot_demo


def _results() -> dict:
    # Two ranks; per step [step, compute, waiting, loss] of rank 0 then rank 1.
    stock = [[0.30, 0.10, 0.20, 3.0, 0.30, 0.28, 0.02, 3.0]] * 5
    planned = [[0.21, 0.17, 0.04, 3.0, 0.22, 0.19, 0.03, 3.0]] * 5
    return {
        "stock": {"rows": stock, "val_losses": [[10, 2.9], [20, 2.5]]},
        "planned": {"rows": planned, "val_losses": [[10, 2.9], [20, 2.5]]},
        "plan_widths": {"heads": [8, 4], "ffn": [1024, 512], "vocab": [171, 85]},
    }


def test_table_reports_the_medians_and_fits_80_columns():
    results = _results()
    assert _per_rank(results["stock"]["rows"], 2) == [0.20, 0.02]
    assert _median_step(results["planned"]) == 0.22  # the slowest rank's step
    console = Console(width=80, record=True)
    console.print(comparison_table(results, [1.0, 0.5]))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "0.200  67%" in text  # rank 0 waits 0.20 of its 0.30 s under the even split
    assert "8/1024" in text and "4/512" in text
    assert "val 2.500" in text


def test_plot_is_written(tmp_path):
    out = plot_demo(_results(), tmp_path / "plot.png")
    assert out.stat().st_size > 10_000
