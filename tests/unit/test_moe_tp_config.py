"""Tensor parallelism around expert parallelism (parallel.tp > 1 with parallel.ep > 1): the
shipped EP=2 x TP=2 YAML validates, packing and pipelining too; every feature not built for it
is one ConfigError naming its field (the same pure check on every rank, before any
collective)."""

from __future__ import annotations

from pathlib import Path

import pytest

from colossal_hetero.config.balancer import BalancerConfig
from colossal_hetero.config.loader import ConfigError, load_config
from colossal_hetero.config.parallel import ParallelConfig
from colossal_hetero.config.schema import HeteroConfig, PlanConfig
from colossal_hetero.moe.checks import check_moe_run
from colossal_hetero.preflight import validate_run
from colossal_hetero.preflight.validate import validate_layout
from tests.unit.test_moe_config import _run

ROOT = Path(__file__).resolve().parents[2]
EP2_TP2 = {"ep": 2, "tp": 2}


def test_shipped_config_validates_as_ep2_tp2() -> None:
    config = load_config(ROOT / "configs" / "mixtral_ep2_tp2.yaml")
    assert validate_run(config, 4) == 2  # dp 2: two tensor-parallel pairs
    assert config.parallel.ep == 2 and config.parallel.tp == 2


def test_ep2_tp2_on_eight_ranks_is_dp4() -> None:
    assert validate_run(_run(EP2_TP2), 8) == 4


@pytest.mark.parametrize("moe", [{"packing": True}, {"pipeline_chunks": 3}])
def test_packing_and_pipelining_run_with_tp(moe: dict) -> None:
    """Checked against a single process in tests/distributed/test_moe_tp.py."""
    assert validate_run(_run(EP2_TP2, moe), 4) == 2


@pytest.mark.parametrize(
    ("parallel", "moe", "hf", "extra", "fragment"),
    [
        ({}, {"replace_every": 5}, None, {}, "moe.replace_every: expert parallelism"),
        (
            {"zero_stage": 1, "precision": "bf16"},
            None,
            None,
            {},
            "parallel.zero_stage: expert parallelism with tensor parallelism",
        ),
        ({"pp": 2}, None, None, {}, "parallel.pp: expert parallelism runs with pp = 1"),
        (
            {},
            None,
            {"intermediate_size": 63},
            {},
            "parallel.tp: 2 does not divide the MLP width 63",
        ),
        ({}, None, {"router_jitter_noise": 0.1}, {}, "model.hf.router_jitter_noise: 0.1"),
        ({}, None, None, {"balancer": {"mode": "resize"}}, "balancer.mode: expert parallelism"),
    ],
)
def test_refused_with_tp_is_one_config_error(parallel, moe, hf, extra, fragment) -> None:  # type: ignore[no-untyped-def]
    world = 8 if parallel.get("pp") else 4
    with pytest.raises(ConfigError) as error:
        validate_run(_run({**EP2_TP2, **parallel}, moe, hf, **extra), world)
    assert fragment in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(("parallel", "dp"), [({"ep": 2}, 4), (EP2_TP2, 2)])
def test_checkpoint_runs_with_and_without_tp(tmp_path: Path, parallel: dict, dp: int) -> None:
    """checkpoint.dir validates with tp 1 and with tp 2 around ep (the EP x TP round trip is
    checked in tests/distributed/test_moe_tp_checkpoint.py)."""
    checkpoint = {"checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 2}}
    assert validate_run(_run(parallel, **checkpoint), 4) == dp


def test_plugin_config_refuses_plan_file_and_balancer() -> None:
    """What the plugin checks at construction (validate_layout, before its engine makes any
    process group): a HeteroConfig has no checkpoint section, but plan.mode file and the
    balancer are refused with tp > 1."""
    parallel = ParallelConfig(ep=2, tp=2)
    plan = HeteroConfig(parallel=parallel, plan=PlanConfig(mode="file", path="p"))
    with pytest.raises(ConfigError, match=r"^plan\.mode: expert parallelism"):
        validate_layout(plan, 4)
    balancer = HeteroConfig(parallel=parallel, balancer=BalancerConfig(mode="resize"))
    with pytest.raises(ConfigError, match=r"^balancer\.mode: expert parallelism"):
        validate_layout(balancer, 4)
    check_moe_run(HeteroConfig(parallel=ParallelConfig(ep=2)))  # tp 1: nothing refused
