"""The shared bench launcher helper: which path it takes, its worker contract, step reports."""

from __future__ import annotations

import pytest

from colossal_hetero.bench import shaped_spawn
from colossal_hetero.bench.shaped_spawn import (
    _qualified,
    _resolve,
    on_shaped_links,
    report_bench_step,
    run_bench_ranks,
    wants_shaped,
)
from colossal_hetero.config.schema import NetworkEmulationConfig
from colossal_hetero.emulation.shaped.controller import STEP_DIR_ENV, job_step
from colossal_hetero.emulation.shaped.topology import SHAPED_ENV


def module_level_worker(*, rank: int, world_size: int, device: object) -> int:
    return rank


def test_wants_shaped_only_for_shaped_mode():
    assert not wants_shaped(None)
    assert not wants_shaped(NetworkEmulationConfig(bandwidth_gbps=0.2))
    assert wants_shaped(NetworkEmulationConfig(mode="shaped", bandwidth_gbps=0.2))


def test_worker_travels_by_name_and_must_be_importable():
    target = _qualified(module_level_worker)
    assert target == f"{__name__}:module_level_worker"
    assert _resolve(target) is module_level_worker

    def local(**_: object) -> None:
        return None

    with pytest.raises(ValueError, match="module-level function"):
        _qualified(local)
    with pytest.raises(ValueError, match="module-level function"):
        _qualified(lambda **_: None)


def test_model_mode_falls_back_to_spawn_ranks(monkeypatch):
    calls = []

    def fake_spawn(fn, world_size, **kwargs):
        calls.append((fn, world_size, kwargs))
        return ["r0", "r1"]

    monkeypatch.setattr("colossal_hetero.bench.spawn.spawn_ranks", fake_spawn)
    monkeypatch.setattr(shaped_spawn, "run_shaped_ranks", pytest.fail)  # never shaped here
    model = NetworkEmulationConfig(bandwidth_gbps=0.2)
    assert run_bench_ranks(module_level_worker, 2, network=model, case=7) == ["r0", "r1"]
    assert run_bench_ranks(module_level_worker, 2, case=8) == ["r0", "r1"]
    assert calls == [(module_level_worker, 2, {"case": 7}), (module_level_worker, 2, {"case": 8})]


def test_shaped_mode_raises_on_leftover_namespaces(monkeypatch):
    monkeypatch.setattr(shaped_spawn, "run_shaped_ranks", lambda *a, **k: ([1, 2], 1))
    shaped = NetworkEmulationConfig(mode="shaped", bandwidth_gbps=0.2)
    with pytest.raises(RuntimeError, match="left 1 namespaces"):
        run_bench_ranks(module_level_worker, 2, network=shaped)


def test_step_reports_reach_the_controller_only_on_shaped_links(tmp_path, monkeypatch):
    monkeypatch.delenv(STEP_DIR_ENV, raising=False)
    monkeypatch.delenv(SHAPED_ENV, raising=False)
    report_bench_step(0, 3)  # no shaped run: nothing written anywhere
    assert not on_shaped_links() and list(tmp_path.iterdir()) == []
    monkeypatch.setenv(STEP_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(SHAPED_ENV, "chs-abc123-")
    report_bench_step(1, 4)
    assert on_shaped_links() and job_step(tmp_path, 2) == 4


def test_bench_static_case_takes_its_link_in_either_mode():
    from dataclasses import replace

    from colossal_hetero.bench import static

    linked = next(c for c in static.cases(quick=False) if c.link_gbps is not None)
    assert static.case_network(linked) == NetworkEmulationConfig(
        mode="model", bandwidth_gbps=linked.link_gbps
    )
    shaped = replace(linked, network_mode="shaped")
    assert wants_shaped(static.case_network(shaped))
    assert static._emulation(shaped, slow_ranks=False).network.mode == "shaped"
    plain = next(c for c in static.cases(quick=True) if c.link_gbps is None)
    assert static.case_network(replace(plain, network_mode="shaped")) is None  # loopback


def test_profile_on_shaped_links_refuses_cuda_ranks():
    from types import SimpleNamespace

    from colossal_hetero.bench.profile import profile_ranks
    from colossal_hetero.config import ConfigError
    from colossal_hetero.config.schema import EmulationConfig

    emulation = EmulationConfig(network=NetworkEmulationConfig(mode="shaped", bandwidth_gbps=1))
    run = SimpleNamespace(cluster=SimpleNamespace(device="cuda"))
    with pytest.raises(ConfigError, match="emulation.network.mode"):
        profile_ranks(2, emulation, run)
