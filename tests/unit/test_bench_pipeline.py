"""bench pipeline's pure parts: the round plan, the tenant trace, the planned splits, the
simulator prediction from gathered rows, and the summary arithmetic. No timing."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from colossal_hetero.bench.pipeline import (
    PREEMPT_PATTERN,
    build_specs,
    job_shares,
    layout_deadline,
    layout_figures,
    phase_plan,
    planned_splits,
    preemptions,
    selected_layouts,
    summarise,
)
from colossal_hetero.bench.pipeline_model import (
    EXIT_RESERVE_S,
    ROW,
    network_config,
    phase_policy,
    stage_peaks,
)


def test_round_plan_and_tenant_trace():
    plan = phase_plan(quick=True)
    assert [plan[p]["start"] for p in "abc"] == [0, 4, 12]
    shares = job_shares(plan)
    assert len(shares) == 16
    b = plan["b"]
    inside = range(b["start"], b["start"] + b["rounds"])
    assert all(shares[r] == 1.0 for r in range(len(shares)) if r not in inside)
    assert shares[b["start"] : b["start"] + 8] == list(PREEMPT_PATTERN)
    # The tenant takes 80-90% of the link whenever it is on.
    assert all(0.1 <= s <= 0.2 for s in shares if s < 1.0)
    specs = preemptions(shares, target_rank=2)
    # Phase (b) opens with the tenant (phase a was free): rounds 4-6 at 85%, 8-10 at 90%.
    assert [(p.start_step, p.end_step, p.factor) for p in specs] == [(4, 7, 0.15), (8, 11, 0.1)]
    assert all(p.kind == "tenant" and p.ranks == [2] for p in specs)
    # Every preempted round is covered by exactly the spec with its share.
    for r, share in enumerate(shares):
        active = [p.factor for p in specs if p.start_step <= r < (p.end_step or 0)]
        assert active == ([] if share == 1.0 else [share])


def _brute_force_max(layers: int, speeds: list[float]) -> float:
    best = float("inf")
    for split in itertools.product(range(1, layers + 1), repeat=len(speeds)):
        if sum(split) == layers:
            best = min(best, max(n / v for n, v in zip(split, speeds, strict=True)))
    return best


@pytest.mark.parametrize(("pp", "tp", "slow_ranks"), [(4, 1, (1,)), (2, 2, (0,)), (2, 2, (0, 1))])
def test_planned_splits(pp, tp, slow_ranks):
    splits = planned_splits(12, pp, tp, slow_ranks, factor=2.0)
    assert splits["even"] == splits["equal"] == [12 // pp] * pp
    # A stage's devices share its blocks in proportion to speed (uneven TP widths).
    device = [0.5 if r in slow_ranks else 1.0 for r in range(pp * tp)]
    speeds = [sum(device[s * tp : (s + 1) * tp]) for s in range(pp)]
    got = max(n / v for n, v in zip(splits["slow"], speeds, strict=True))
    assert sum(splits["slow"]) == 12
    assert got == _brute_force_max(12, speeds)
    # Even split and even widths: a stage runs at tp times its slowest device. By hand: PP=4
    # 3 / 0.5 = 6 against [4, 2, 3, 3]'s 4; one slow device of a TP pair 6 / 1 against
    # [5, 7]'s 3.5 (widths 1 : 2 on stage 0); a slow pair 6 / 1 against [4, 8]'s 4.
    even = max(n / (tp * min(device[s * tp : (s + 1) * tp])) for s, n in enumerate(splits["even"]))
    expected = {(1,): 1.5, (0,): 6 / 3.5, (0, 1): 1.5}[tuple(slow_ranks)]
    assert even / got == pytest.approx(expected)


def test_specs_and_network():
    pp4, mixed = build_specs(quick=True, network_mode="shaped")
    assert (pp4.pp, pp4.tp, pp4.m, pp4.budget_microbatches) == (4, 1, 16, 12.0)
    assert (mixed.pp, mixed.tp, mixed.m) == (2, 2, 8)
    # Phase (c)'s half-speed device: PP=4's stage 1; one of PP=2 x TP=2's stage-0 TP pair.
    assert (pp4.slow_ranks, mixed.slow_ranks) == ((1,), (0,))
    # k1_even (phase c's extra) only in full runs; ada_link_shares only there, with TP.
    assert not pp4.even_k1 and not mixed.even_k1
    assert not pp4.link_shares_variant and not mixed.link_shares_variant
    full = build_specs(quick=False, network_mode="shaped")
    assert all(s.even_k1 for s in full)
    assert [s.link_shares_variant for s in full] == [False, True]
    assert pp4.batch_size % pp4.m == 0 and mixed.batch_size % mixed.m == 0
    net = network_config(mixed.to_dict(), "shaped")
    assert net.mode == "shaped" and net.bandwidth_gbps == mixed.rate_gbps
    # TP pairs inside each stage get their own fast class; stage links use the default.
    assert [link.ranks for link in net.links] == [[0, 1], [2, 3]]
    assert network_config(pp4.to_dict(), "model").links == []
    # The model carries the tenant trace itself (round numbers as steps); shaped links leave
    # it to the launcher, which runs real traffic on the reported rounds.
    assert network_config(mixed.to_dict(), "shaped").preemptions == []
    model = network_config(mixed.to_dict(), "model")
    assert model.preemptions == preemptions(mixed.shares, mixed.target_rank) != []


def test_every_phase_runs_on_emulated_devices_of_their_own():
    from colossal_hetero.bench.pipeline_worker import _phase_devices

    pp4, mixed = (s.to_dict() for s in build_specs(quick=True, network_mode="shaped"))
    # (a) and (b): every rank a full-speed device 2.5x slower than a core; (c): 6x, and the
    # slow rank (PP=4's rank 1, PP=2 x TP=2's rank 0) at half of that.
    assert (pp4["free_base"], pp4["device_base"], pp4["slow_factor"]) == (2.5, 6.0, 2.0)
    assert _phase_devices(pp4, 1) == {"a": (1.0, 2.5), "b": (1.0, 2.5), "c": (2.0, 6.0)}
    assert _phase_devices(pp4, 0)["c"] == (1.0, 6.0)
    assert _phase_devices(mixed, 0)["c"] == (2.0, 6.0)
    assert all(_phase_devices(mixed, r)["c"] == (1.0, 6.0) for r in (1, 2, 3))


def test_layout_selection_for_iterating_on_one():
    specs = build_specs(quick=True, network_mode="model")
    assert selected_layouts(specs, "") == specs
    assert [s.name for s in selected_layouts(specs, " pp2xtp2 ")] == ["pp2xtp2"]
    assert [s.name for s in selected_layouts(specs, "pp2xtp2,pp4")] == ["pp4", "pp2xtp2"]
    with pytest.raises(ValueError, match="unknown layout.*pp8"):
        selected_layouts(specs, "pp4,pp8")


def test_stage_peaks():
    rows = [[0.0, 0.0, 1.0, peak, 0.0] for peak in (3.0, 5.0, 1.0)]
    assert len(rows[0]) == len(ROW)
    assert stage_peaks(rows, [0, 0, 1], 2) == [5.0, 1.0]


def _result(stock: float, ada: float, k2: float, *, ada_peak: float) -> dict[str, Any]:
    rounds = 4

    def series(step: dict[str, float]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for name, t in step.items():
            out[f"{name}.step"] = [t] * rounds
            out[f"{name}.pipe"] = [t] * rounds
            out[f"{name}.mem0"] = [ada_peak if name == "ada" else 1.0] * rounds
            if name.startswith("k") or name == "ada":
                out[f"{name}.sim"] = [t * 1.1] * rounds
                out[f"{name}.meas"] = [t] * rounds
        return out

    steps = {"stock": stock, "planned_1f1b": stock, "k1": stock, "k2": k2, "ada": ada}
    # (c): k1 on the planned split 1.25x faster than stock; k1_even (our k = 1 on the even
    # split) faster than every static k, yet no static k of ada's split.
    slow = {**steps, "planned_1f1b": stock / 1.4, "k1": stock / 1.25, "k1_even": 0.9}
    return {
        "phases": {
            "a": {"series": series(steps), "rounds": rounds, "first_round": 0},
            "b": {"series": series(steps), "rounds": rounds, "first_round": 4},
            "c": {"series": series(slow), "rounds": rounds, "first_round": 8},
        },
        "ada": {"equal": {"budget_mib": 1.0}, "slow": {"budget_mib": 1.0}},
    }


def test_summary_arithmetic():
    spec = {"shares": [1.0] * 4 + [1.0, 0.1, 0.1, 1.0] + [1.0] * 4}
    good = layout_figures(spec, _result(2.0, 1.0, 1.02, ada_peak=2**20))
    assert good["ada_vs_1f1b_preempted"]["value"] == pytest.approx(2.0)
    assert good["ada_vs_1f1b_preempted"]["rounds"] == 2
    assert good["ada_vs_best_static_k_a"]["best"] == "k2"
    assert good["ada_vs_best_static_k_a"]["value"] == pytest.approx(1.02)
    assert good["planned_vs_even_split_slow_stage"]["value"] == pytest.approx(1.4)
    # 0.9 / (2.0 / 1.25)
    assert good["planned_vs_even_split_slow_stage_kfkb_k1"]["value"] == pytest.approx(0.5625)
    assert good["ada_vs_best_static_k_c"]["best"] == "k2"
    assert max(good["sim_error"].values()) == pytest.approx(0.1)
    worse = layout_figures(spec, _result(1.5, 1.0, 0.9, ada_peak=2**20 + 1))
    summary = summarise("shaped", {"x": good, "y": worse})
    assert summary == {
        "network_mode": "shaped",
        "ada_vs_1f1b_preempted": pytest.approx(1.5),
        "ada_vs_1f1b_unpreempted": pytest.approx(1.5),
        "ada_vs_best_static_k": pytest.approx(0.9),
        "planned_vs_even_split_slow_stage": pytest.approx(1.4),
        "planned_vs_even_split_slow_stage_kfkb_k1": pytest.approx(0.5625),  # worse: 0.75
        "sim_max_error": pytest.approx(0.1),
        "memory_limit_exceeded": True,
    }
    assert not good["memory"]["exceeded"] and worse["memory"]["exceeded"]
    # --quick runs no k1_even (BenchSpec.even_k1): the extra figure and key are left out, the
    # rest is the same.
    quick = _result(2.0, 1.0, 1.02, ada_peak=2**20)
    for key in [k for k in quick["phases"]["c"]["series"] if k.startswith("k1_even.")]:
        del quick["phases"]["c"]["series"][key]
    lean = layout_figures(spec, quick)
    assert "planned_vs_even_split_slow_stage_kfkb_k1" not in lean
    assert lean["planned_vs_even_split_slow_stage"] == good["planned_vs_even_split_slow_stage"]
    lean_summary = summarise("shaped", {"x": lean, "y": worse})
    assert lean_summary == {
        k: v for k, v in summary.items() if k != "planned_vs_even_split_slow_stage_kfkb_k1"
    }
    assert "link_shares_vs_equal_pieces_preempted" not in good


def test_link_shares_figures_from_their_variant():
    # ada_link_shares (full runs with TP) runs (a) and (b): 1.0 s a step against ada's 1.2 in
    # (b)'s two preempted rounds (ada's steps are 1.0 in _result), as fast in the others and
    # in (a).
    spec = {"shares": [1.0] * 4 + [1.0, 0.1, 0.1, 1.0] + [1.0] * 4}
    result = _result(2.0, 1.0, 1.02, ada_peak=2**20)
    result["phases"]["b"]["series"]["ada.step"] = [1.0, 1.2, 1.2, 1.0]
    for phase in "ab":
        result["phases"][phase]["series"]["ada_link_shares.step"] = [1.0] * 4
    figures = layout_figures(spec, result)
    assert figures["link_shares_vs_equal_pieces_preempted"]["value"] == pytest.approx(1.2)
    assert figures["link_shares_vs_equal_pieces_preempted"]["rounds"] == 2
    assert figures["link_shares_vs_equal_pieces_unpreempted"]["value"] == pytest.approx(1.0)


def test_stretch_sleeps_in_proportion_and_keeps_gradients():
    import torch

    from colossal_hetero.bench.pipeline_stretch import Stretch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(256, 256)

        def forward(self, hidden: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor]:
            return (torch.tanh(self.linear(hidden)) * scale,)

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Block(), Block()])
    x = torch.randn(64, 256, requires_grad=True)

    def run() -> list[torch.Tensor]:
        h = x
        for block in blocks:
            h = block(h, scale=0.5)[0]
        h.sum().backward()
        assert x.grad is not None
        grads = [x.grad.clone()]
        for p in blocks.parameters():
            assert p.grad is not None
            grads.append(p.grad.clone())
        x.grad = None
        blocks.zero_grad()
        return grads

    want = run()
    slept: list[float] = []
    stretch = Stretch(factor=3.0, sleep=slept.append)  # record each stretch, sleep none
    stretch.attach(blocks)
    assert all(torch.equal(a, b) for a, b in zip(run(), want, strict=True))
    assert slept == []  # disabled: nothing stretched
    stretch.enabled = True
    got = run()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # two forwards and two backwards, each stretched once, by the block's own CPU time
    assert len(slept) == 4 and all(s > 0.0 for s in slept)
    assert stretch.slept_s == pytest.approx(sum(slept))
    stretch.detach()
    slept.clear()
    run()
    assert slept == []


def test_best_static_k_only_among_those_within_the_budget():
    spec = {"shares": [1.0] * 4 + [1.0, 0.1, 0.1, 1.0] + [1.0] * 4}
    result = _result(2.0, 1.0, 0.5, ada_peak=1.0)  # k2 twice as fast as ada...
    for phase in result["phases"].values():
        phase["series"]["k2.mem0"] = [2.0**21] * 4  # ...but over ada's 1 MiB budget
    figures = layout_figures(spec, result)
    assert figures["ada_vs_best_static_k_a"]["best"] == "k1"
    assert figures["ada_vs_best_static_k_a"]["value"] == pytest.approx(2.0)
    assert figures["ada_vs_best_static_k_a_any_memory"]["best"] == "k2"
    assert figures["ada_vs_best_static_k_a_any_memory"]["value"] == pytest.approx(0.5)
    # the lowest phase: (c), where k1 runs 2.0 / 1.25 (k1_even, faster, is not ada's split)
    assert figures["ada_vs_best_static_k_c"]["best"] == "k1"
    assert summarise("shaped", {"x": figures})["ada_vs_best_static_k"] == pytest.approx(1.6)


def test_phase_c_variants_plan_uneven_widths_on_the_slow_devices_stage():
    import torch

    from colossal_hetero.bench.pipeline_model import build_configs, model_config
    from colossal_hetero.models import build_model
    from colossal_hetero.planner.resolve import (
        needs_calibration,
        stage_widths_for_model,
        wants_stage_plan,
        wants_stage_widths,
    )

    _, mixed = build_specs(quick=True, network_mode="model")
    spec = mixed.to_dict()
    _, slow = build_configs(spec, "slow", torch.device("cpu"), layers=[6, 6])
    _, equal = build_configs(spec, "equal", torch.device("cpu"))
    for name in ("planned_1f1b", "k1", "ada"):
        config = slow[name]
        assert config.cluster.speeds(4) == [0.5, 1.0, 1.0, 1.0]
        # The split stays the configured (measured) one; the widths are planned per stage.
        assert wants_stage_widths(config) and not wants_stage_plan(config)
        assert name == "planned_1f1b" or not wants_stage_widths(equal[name])
    model = build_model(model_config(spec))
    plans = stage_widths_for_model(slow["planned_1f1b"], model, 4, (16, 32), [6, 6])
    stage0, stage1 = (plan.widths for plan in plans)
    # Rank 0 (half speed) gets the smaller share of stage 0's heads and MLP; stage 1 is even.
    assert stage0["heads"][0] < stage0["heads"][1] and sum(stage0["heads"]) == 4
    assert stage0["ffn"][0] < stage0["ffn"][1] and sum(stage0["ffn"]) == 512
    assert stage1["heads"] == (2, 2) and stage1["ffn"] == (256, 256)
    # The device model measured once per layout goes into every planned variant's plan (the
    # plugin then probes no more); the equal set, planned even, takes none.
    model_probe = {"flops": 7e10, "layer_overhead_s": 1e-4, "gbps": 0.007, "latency_s": 2e-4}
    _, measured = build_configs({**spec, "device_model": model_probe}, "slow", torch.device("cpu"))
    for name in ("planned_1f1b", "k1", "ada"):
        plan = measured[name].plan
        assert not needs_calibration(measured[name]) and needs_calibration(slow[name])
        assert plan.reference_tflops == pytest.approx(0.07)
        assert plan.layer_overhead_us == pytest.approx(100.0)
        assert plan.latency_us == pytest.approx(200.0)
        assert all(d.bandwidth_gbps == 0.007 for d in measured[name].cluster.devices)


def test_phase_c_planned_split_comes_from_the_plugin_given_stage_times():
    """With measured ``stage_times`` in the spec and no layers, the planned variants carry
    ``plan.stage_times`` and no split, and the plugin's stage plan is the hand-computed one."""
    import torch

    from colossal_hetero.bench.pipeline_model import build_configs
    from colossal_hetero.planner.resolve import stage_plan_for, wants_stage_plan
    from tests.unit.test_planner_stage_times import _spec

    pp4, _ = build_specs(quick=True, network_mode="model")
    # Stage 1 (the half-speed device) 20 ms a block, the others 10 ms; stage 3's head 30 ms.
    times = [[0.01, 0.0], [0.02, 0.0], [0.01, 0.0], [0.01, 0.03]]
    spec = {**pp4.to_dict(), "stage_times": times}
    _, slow = build_configs(spec, "slow", torch.device("cpu"))
    for name in ("planned_1f1b", "k1", "ada"):
        config = slow[name]
        assert config.parallel.num_layers_per_stage == [] and wants_stage_plan(config)
        assert [[t.block_s, t.fixed_s] for t in config.plan.stage_times] == times
    # 12 blocks: [4, 2, 4, 2] has slowest stages 40 ms (0, 1, 2) and 20 + 30 = 50 ms (3);
    # [4, 2, 5, 1]: 50 ms on stage 2, 40 on stage 3: both 50 ms, no split has less
    # (a 40 ms bound holds at most 4 + 2 + 4 + 1 = 11 blocks).
    plan = stage_plan_for(slow["planned_1f1b"], _spec(12), 4)
    got = plan.layers_per_stage
    measured: tuple[float, ...] = plan.measured_stage_s
    assert sum(got) == 12 and measured[0] == pytest.approx(0.05)
    # An explicit split (a trial's pick) overrides: no stage times, the configured layers.
    _, fixed = build_configs(spec, "slow", torch.device("cpu"), layers=[4, 2, 4, 2])
    assert fixed["k1"].parallel.num_layers_per_stage == [4, 2, 4, 2]
    assert fixed["k1"].plan.stage_times == []


def test_first_free_round_after_a_tenant_stretch_drains():
    from colossal_hetero.bench.pipeline_worker import Phases

    pp4, _ = build_specs(quick=True, network_mode="shaped")
    spec = pp4.to_dict()
    phases = Phases(spec, rank=0)
    waits = {n: phases.drain_s(n) for n in range(len(spec["shares"]))}
    # Quick plan: stretches in rounds 4-6 and 8-10 (test_round_plan_and_tenant_trace), so
    # rounds 7 and 11 (phase b's free ones) wait; no other round does.
    assert {n for n, w in waits.items() if w > 0} == {7, 11}
    assert waits[7] == spec["drain_s"] == 1.0
    # The tenant's settling wait: only where the link's share changes (on at 4 and 8, off at
    # 7 and 11).
    settles = {n for n in range(len(spec["shares"])) if phases.settle_s(n) > 0}
    assert settles == {4, 7, 8, 11}
    assert phases.settle_s(4) == spec["settle_s"] == 0.3
    # The model's trace acts at the round itself and leaves no tenant bytes: no waits.
    modelled = Phases(build_specs(quick=True, network_mode="model")[0].to_dict(), rank=0)
    rounds = range(len(spec["shares"]))
    assert not any(modelled.drain_s(n) or modelled.settle_s(n) for n in rounds)


def test_the_first_step_after_a_stretch_is_preceded_by_an_unrecorded_one(monkeypatch):
    from colossal_hetero.bench import pipeline_worker as worker

    pp4, _ = build_specs(quick=True, network_mode="shaped")
    spec = {**pp4.to_dict(), "settle_s": 0.0, "drain_s": 1e-6}
    seeds: list[int] = []
    rounds_read: list[int] = []

    class FakeRunner:
        kfkb = False

        def step(self, seed: int) -> list[float]:
            seeds.append(seed)
            rounds_read.append(self.running_round())
            return [0.1, 0.1, 1.0, 0.0, 0.0]

        def follow_rounds(self, running_round: Any) -> None:
            self.running_round = running_round

    monkeypatch.setattr(worker, "report_bench_step", lambda rank, number: None)
    monkeypatch.setattr(worker.dist, "barrier", lambda: None)
    monkeypatch.setattr(worker, "gather_rows", lambda row: [row] * 4)
    phases = worker.Phases(spec, rank=0)
    fakes: list[Any] = [FakeRunner(), FakeRunner()]
    first, second = (phases.variant(fake) for fake in fakes)
    phases.offset = 4  # phase b: its round 3 is global round 7, the first free after 4-6
    for index in range(6):
        first(index, warmup=False)
        second(index, warmup=False)
    # Round 7's first variant ran the unrecorded step, then its own; nobody else did.
    assert seeds == [4, 4, 5, 5, 6, 6, worker.WARM_SEED, 7, 7, 8, 8, 9, 9]
    # Every step, the unrecorded one too, reads the links at the round it runs in.
    assert rounds_read == [4, 4, 5, 5, 6, 6, 7, 7, 7, 8, 8, 9, 9]


class _FakeStretch:
    """What measure_stage_times reads of a Stretch: totals it advances per step."""

    def __init__(self) -> None:
        self.enabled = False
        self.passes_s = self.passes = self.cpu_s = self.work_s = self.compute_wall_s = 0.0
        self.slept_s = self.intervals = 0.0


class _FakeProbe:
    """One stage of 2 blocks, m = 4: each step runs 2 blocks x 4 micro-batches x (F + B) = 16
    block passes of 5 ms when stretched (2 ms when not), and 60 ms of forward_step /
    backward_step in all stretched."""

    def __init__(self, stretch: _FakeStretch, steps: int) -> None:
        self.stretch, self.steps, self.log = stretch, steps, []
        self.meter = type("Meter", (), {"busy_s": 0.0})()

    def step(self, seed: int) -> list[float]:
        self.log.append(self.stretch.enabled)
        per_pass = 0.005 if self.stretch.enabled else 0.002
        self.stretch.passes += 16
        self.stretch.passes_s += 16 * per_pass
        self.meter.busy_s += 16 * per_pass + 0.02
        self.steps += 1
        return [0.0] * 5


@pytest.mark.parametrize("warm", [0, 1])
def test_stage_times_probe_warms_only_a_fresh_probe_and_off_the_stretch(monkeypatch, warm):
    from colossal_hetero.bench import pipeline_split as split

    monkeypatch.setattr(split, "gather_rows", lambda row: [row] * 2)
    stretch = _FakeStretch()
    probe = _FakeProbe(stretch, steps=warm)
    spec = {"m": 4, "pp": 1}
    got = split.measure_stage_times(probe, stretch, [0, 0], spec, steps=3)  # type: ignore[arg-type]
    # A fresh probe: one unrecorded step without the stretch, then 3 with it; a warm one: 3.
    assert probe.log == ([False] if warm == 0 else []) + [True, True, True]
    assert not stretch.enabled
    # Per block and micro-batch: 2 passes of 5 ms; the rest: 20 ms over 4 micro-batches.
    assert got["block_s"] == [pytest.approx(0.010)]
    assert got["fixed_s"] == [pytest.approx(0.005)]


def test_stretch_by_rank_is_each_ranks_totals_over_the_span(monkeypatch):
    from types import SimpleNamespace

    from colossal_hetero.bench import pipeline_split as split

    monkeypatch.setattr(split, "gather_rows", lambda row: [row, [2 * x for x in row]])
    stretch = SimpleNamespace(
        cpu_s=1.0,
        work_s=0.9,
        compute_wall_s=1.5,
        slept_s=2.0,
        passes_s=4.0,
        passes=10,
        intervals=40,
    )
    before = split.stretch_totals(stretch)  # type: ignore[arg-type]
    stretch.cpu_s, stretch.compute_wall_s, stretch.slept_s = 1.25, 1.8, 2.5
    stretch.work_s = 1.1
    stretch.passes_s, stretch.passes, stretch.intervals = 5.0, 14, 56
    mine, other = split.stretch_by_rank(before, stretch)  # type: ignore[arg-type]
    assert mine == pytest.approx(
        {
            "cpu_s": 0.25,
            "work_s": 0.2,
            "compute_wall_s": 0.3,
            "slept_s": 0.5,
            "passes_s": 1.0,
            "passes": 4,
            "intervals": 16,
        }
    )
    assert other["cpu_s"] == pytest.approx(0.5) and other["intervals"] == pytest.approx(32)


def test_brute_force_split_summary_by_hand():
    from colossal_hetero.bench.pipeline_brute import (
        EVEN_WIDTH_SPLITS,
        PLANNED_WIDTH_SPLITS,
        summarise_steps,
    )

    # Per-round ratios stock / this: 2/1, 3/1.5, 2.4/1.2 -> all 2.0; medians of steps 2.4, 1.2.
    got = summarise_steps({"stock": [2.0, 3.0, 2.4], "x": [1.0, 1.5, 1.2]})
    assert got["x"] == {"median_s": pytest.approx(1.2), "stock_over": pytest.approx(2.0)}
    assert got["stock"]["stock_over"] == 1.0
    # Every candidate split holds the 12 blocks over 2 stages, each stage at least one.
    for split in (*PLANNED_WIDTH_SPLITS, *EVEN_WIDTH_SPLITS):
        assert len(split) == 2 and sum(split) == 12 and min(split) >= 1


def test_quick_rounds_share_the_deadline():
    # A layout gets its share of the time left among the layouts still to run.
    now, end = 1000.0, 1270.0
    first = layout_deadline(now, end, "pp4", ["pp4", "pp2xtp2"])
    assert first == pytest.approx(now + 270.0 * 107.0 / 287.0)
    assert layout_deadline(first, end, "pp2xtp2", ["pp2xtp2"]) == end
    assert layout_deadline(end + 5, end, "pp2xtp2", ["pp2xtp2"]) == end + 5  # late: no time
    spec = build_specs(quick=True, network_mode="model")[0].to_dict()
    # No deadline (full runs, and quick ones given none): every planned round, no early stop.
    for phase in "abc":
        policy = phase_policy(spec, phase, now)
        planned = spec["phases"][phase]["rounds"]
        assert (policy.min_rounds, policy.max_rounds, policy.project) == (planned, planned, False)
        assert policy.target_half_width == 0.0
    # With one: phase a gets 25/204 of the time left less the exit reserve, phase c all of it.
    spec["deadline"] = now + 100.0 + EXIT_RESERVE_S
    a, c = phase_policy(spec, "a", now), phase_policy(spec, "c", now)
    assert a.budget_s == pytest.approx(100.0 * 25.0 / 204.0) and c.budget_s == pytest.approx(100.0)
    assert a.project and (a.min_rounds, a.max_rounds) == (3, 4)
    assert (phase_policy(spec, "b", now).min_rounds, c.min_rounds) == (3, 2)
    assert phase_policy(spec, "c", now + 200.0).budget_s == 0.0  # past it: the least rounds


def test_timed_steps_run_without_automatic_collections_and_the_log_counts_them():
    import gc

    from colossal_hetero.bench.pipeline_runner import CollectorLog, collector_paused

    was = gc.isenabled()
    gc.enable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("a step failed")
        assert gc.isenabled()  # restored on the way out of a failure too
        gc.disable()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # off before: left off
        gc.enable()

        log = CollectorLog().install()
        try:
            with collector_paused():  # only the explicit collections below
                gc.collect(0)
                gc.collect(2)
                gc.collect(2)
        finally:
            log.uninstall()
        gc.collect(1)  # after uninstall: not counted
        assert log.collections == [1, 0, 2]
        assert all(s >= 0.0 for s in log.seconds) and log.longest_s >= max(log.seconds) / 2
    finally:
        (gc.enable if was else gc.disable)()
