"""``colossal-hetero bench --network``: which links each benchmark runs on, and one clear
error where the choice does not apply. No ranks are launched."""

from __future__ import annotations

import pytest

from colossal_hetero.bench import pipeline as bench_pipeline
from colossal_hetero.bench import run_benchmark
from colossal_hetero.cli import build_parser
from colossal_hetero.config import ConfigError


def _unsupported() -> None:
    raise ConfigError("emulation.network.mode: shaped needs root")


def test_pipeline_links_follow_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from colossal_hetero.emulation.shaped import netns

    monkeypatch.setattr(netns, "check_shaped_support", lambda: None)
    assert bench_pipeline.network_mode(None) == ("shaped", "")
    assert bench_pipeline.network_mode("shaped") == ("shaped", "")
    assert bench_pipeline.network_mode("model") == ("model", "")  # asked for: no fallback note
    monkeypatch.setattr(netns, "check_shaped_support", _unsupported)
    assert bench_pipeline.network_mode(None) == (
        "model",
        "emulation.network.mode: shaped needs root",
    )
    assert bench_pipeline.network_mode("model") == ("model", "")
    with pytest.raises(ConfigError, match="--network shaped: .*needs root"):
        bench_pipeline.network_mode("shaped")


def test_network_choice_is_refused_where_a_benchmark_picks_its_own_links() -> None:
    for name in ("network", "moe", "dynamic", "tp2d", "kernels"):
        with pytest.raises(ConfigError, match=f"--network: bench {name} picks its own links"):
            run_benchmark(name, quick=True, network="model")


def test_the_cli_leaves_the_choice_to_each_benchmark_by_default() -> None:
    parser = build_parser()
    assert parser.parse_args(["bench", "pipeline"]).network is None
    assert parser.parse_args(["bench", "pipeline", "--network", "model"]).network == "model"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "pipeline", "--network", "fast"])
