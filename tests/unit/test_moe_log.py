"""Pure parts of the MoE step log: chunks inside a2a spans, the bench's a2a split and summary,
the timeline PNG. Hand-built logs, hand-counted answers."""

from __future__ import annotations

from colossal_hetero.bench.moe import _ratios, a2a_split
from colossal_hetero.bench.moe_report import ep4_summary, summarise
from colossal_hetero.moe.comm import chunks_inside
from colossal_hetero.moe.timeline import plot_timelines

# (kind, group, id, t_launch, t_done, bytes)
LOG = [
    ("pending", "ep", 0, 0.0, 1.0, 0),
    ("a2a", "ep", 1, 0.1, 0.2, 32),  # routing counts: too small to count as a dispatch
    ("a2a", "ep", 2, 0.2, 0.4, 4096),
    ("a2a", "ep", 3, 0.6, 0.9, 4096),
    ("chunk", "dense", 0, 1.5, 2.0, 1024),
    ("pending", "ep", 4, 2.0, 3.0, 0),
    ("a2a", "ep", 5, 2.1, 2.6, 4096),
    ("chunk", "expert", 0, 2.5, 3.5, 1024),  # inside a pending span and inside a2a 5
    ("a2a", "ep", 6, 2.7, 3.1, 4096),
    ("chunk", "expert", 1, 3.2, 3.6, 1024),
]


def test_chunks_inside_counts_launches_strictly_inside() -> None:
    assert chunks_inside(LOG, "pending") == 1
    assert chunks_inside(LOG, "a2a") == 1
    assert chunks_inside([r for r in LOG if r[2] != 0 or r[0] != "chunk"], "a2a") == 0


def test_a2a_split_halves_and_overlap() -> None:
    spans = [(0.2, 0.4), (0.6, 0.9), (2.1, 2.6), (2.7, 3.1)]  # forward two, backward two
    forward, backward, overlapped = a2a_split(spans, [(1.5, 2.0), (2.5, 3.5)])
    assert abs(forward - 0.25) < 1e-12  # median of 0.2 and 0.3
    assert abs(backward - 0.45) < 1e-12  # median of 0.5 and 0.4
    assert overlapped == 0.5  # the chunk (2.5, 3.5) overlaps both backward spans
    assert a2a_split([], []) == (0.0, 0.0, 0.0)


def test_summary_keys_and_nulls() -> None:
    def interval(value: float) -> dict:
        return {"value": value, "ci": [value, value], "half_width": 0.0}

    medians = {
        "stock.step": 2.0,
        "stock.comm": 1.0,
        "stock.transfer": 0.8,
        "ours_on.a2a_under": 0.22,
        "ours_on.a2a_alone": 0.2,
        "ours_off.a2a_under": 0.6,
        "ours_off.a2a_alone": 0.2,
        "ours_hold.a2a_under": 0.3,
        "ours_hold.a2a_alone": 0.2,
        "ours_off.a2a_overlapped": 0.5,
        "ours_hold.a2a_overlapped": 0.25,
        "ours_on.a2a_overlapped": 0.0,
        "ours_all.a2a_overlapped": 0.0,
        "ours_pipe.a2a_overlapped": 0.0,
        "ours_pack.a2a_overlapped": 0.0,
        "ours_s7.a2a_overlapped": 0.0,
        "ours_on.step": 0.1,
        "ours_pipe.step": 0.112,
        **{
            f"{name}.a2a_bytes": 1000.0
            for name in ("ours_off", "ours_hold", "ours_pipe", "ours_s7")
        },
        "ours_on.a2a_bytes": 1000.0,
        "ours_all.a2a_bytes": 1000.0,
        "ours_pack.a2a_bytes": 850.0,
    }
    result = {
        "rounds": {
            "medians": {k: interval(v) for k, v in medians.items()},
            "figures": {
                k: interval(v)
                for k, v in {
                    "ours_on_vs_stock": 1.2,
                    "ours_all_vs_stock": 1.3,
                    "all_vs_on": 1.01,
                    "pipe_vs_on": 0.9,
                    "ours_off_vs_stock": 1.1,
                    "on_vs_off": 1.05,
                    "on_vs_hold": 1.02,
                    "pack_vs_on": 0.85,
                    "all_vs_s7": 1.02,
                }.items()
            },
            "series": {"stock.pg_calls": [20.0, 22.0], "stock.missed": [0.0, 1.0]},
        },
        "max_loss_diff_vs_stock": 0.004,
        # the choice as logged (keys are strings after JSON): 2 ranges predicted 5 ms slower
        "pipelining": {"ranges": 1, "predicted_s": {"1": 0.010, "2": 0.015}},
    }
    summary = summarise(result, "shaped")
    assert summary["collectives_outside_interceptor"] == {
        "stock": {"pg_calls_per_step": 22.0, "missed_max": 1.0}
    }
    assert summary["emulation"].startswith("dedicated") and summary["link_rate_mbit"] > 0
    assert summary["stock_comm_fraction"] == 0.4
    assert summary["stock_comm_fraction_with_waits"] == 0.5
    assert abs(summary["a2a_under_allreduce_over_alone"] - 1.1) < 1e-12
    assert abs(summary["a2a_under_allreduce_over_alone_priority_off"] - 3.0) < 1e-12
    assert abs(summary["a2a_under_allreduce_over_alone_hold"] - 1.5) < 1e-12
    assert summary["a2a_with_chunks_on_wire"]["ours_off"] == 0.5 and summary["fit_vs_hold"] == 1.02
    assert summary["priority_on_vs_colossalai_moe"] == 1.2
    assert summary["pipelining_on_vs_off"] == 0.9 and summary["all_on_vs_priority_on"] == 1.01
    assert summary["pipelining_ranges_chosen"] == 1
    assert summary["pipelining_decided_in_warmup"] is None  # no decided_at in this record
    result["pipelining"]["decided_at"] = 8  # after the trial: WARMUP = 2 + 1 + 2 * 3 rounds
    assert summarise(result, "shaped")["pipelining_decided_in_warmup"] is True
    delta = summary["pipelining_step_delta_ms"]  # 112 - 100 ms; 2 layers x 5 ms
    assert abs(delta["measured"] - 12.0) < 1e-9 and abs(delta["predicted"] - 10.0) < 1e-9
    assert summary["all_on_vs_colossalai_moe"] == 1.3 and summary["network_mode"] == "shaped"
    assert summary["packing_on_vs_priority_on"] == 0.85
    assert summary["all_on_vs_session7_all_on"] == 1.02
    assert summary["all_on_vs_hold"] is None  # no such figure in this result
    assert abs(summary["packing_a2a_bytes_saved"] - 0.15) < 1e-12  # 1 - 850 / 1000
    assert summary["a2a_bytes_per_step"]["ours_pack"] == 850.0
    assert summary["all_on_vs_deepspeed_moe"] is None and summary["all_on_vs_deepspeed_moe_reason"]
    assert "ep4" not in summary  # no EP=4 figure in this result
    del result["rounds"]["figures"]["all_vs_s7"]  # --quick leaves session 7's all on out
    assert summarise(result, "shaped")["all_on_vs_session7_all_on"] is None


def test_ep4_section_from_its_paired_figures() -> None:
    ci = {"value": 1.6, "ci": [1.5, 1.7], "half_width": 0.06}
    result = {
        "rounds": {
            "figures": {"ep4_all_vs_stock": ci},
            "medians": {"stock_ep4.step": {"value": 0.32}, "ours_all_ep4.step": {"value": 0.2}},
        },
        "pipelining_ep4": {"ranges": 1},
    }
    section = ep4_summary(result)["ep4"]
    assert section["all_on_vs_colossalai_moe"] == 1.6
    assert section["all_on_vs_colossalai_moe_ci"] == [1.5, 1.7]
    assert section["step_s"] == {"stock_ep4": 0.32, "ours_all_ep4": 0.2}
    assert "all_on_vs_deepspeed_moe" not in section  # DeepSpeed's EP=4 figure absent
    result["rounds"]["figures"]["ep4_all_vs_deepspeed"] = {"value": 1.4, "ci": [1.3, 1.5]}
    assert ep4_summary(result)["ep4"]["all_on_vs_deepspeed_moe"] == 1.4


def test_ratios_skip_variants_that_did_not_run() -> None:
    everything = ["stock", "ours_all", "ours_s7", "stock_ep4", "ours_all_ep4"]
    assert "all_vs_s7" in _ratios(everything)
    assert "all_vs_s7" not in _ratios([n for n in everything if n != "ours_s7"])
    step = {"stock_ep4.step": 0.3, "ours_all_ep4.step": 0.2}
    assert abs(_ratios(everything)["ep4_all_vs_stock"](step) - 1.5) < 1e-12


def test_timeline_png(tmp_path) -> None:
    path = tmp_path / "t.png"
    plot_timelines({"off": LOG, "on": LOG[:5]}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
