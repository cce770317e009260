"""Bad balancer configs give one clear error naming the field; layouts the mode cannot run
are refused by the plugin's check (before any collective)."""

from __future__ import annotations

import pytest

from colossal_hetero.balance.checks import check_balancer, needs_resizable
from colossal_hetero.balance.wiring import declared_speeds
from colossal_hetero.config import ConfigError, HeteroConfig, ParallelConfig, RunConfig, from_dict
from colossal_hetero.config.schema import BalancerConfig, PlanConfig


@pytest.mark.parametrize(
    ("balancer", "message"),
    [
        ({"mode": "resize", "accuracy_budget": -0.1}, r"^balancer\.accuracy_budget: must be in"),
        ({"mode": "migrate", "freeze_dropped": "yes"}, r"^balancer\.freeze_dropped: "),
        ({"mode": "fast"}, r"^balancer\.mode: must be one of"),
        ({"mode": "replan", "every": 0}, r"^balancer\.every: must be >= 1, got 0"),
        ({"window": 0}, r"^balancer\.window: must be >= 1"),
        ({"smoothing": 0}, r"^balancer\.smoothing: must be in \(0, 1\]"),
        ({"threshold": 0.1, "release": 0.2}, r"^balancer\.release: must be in \[0, threshold"),
        ({"fixed_fraction": 1.0}, r"^balancer\.fixed_fraction: must be in \[0, 1\)"),
        ({"accuracy_budget": 1.0}, r"^balancer\.accuracy_budget: must be in \[0, 1\)"),
        ({"move_cost_s": -1}, r"^balancer\.move_cost_s: must be >= 0"),
        ({"horizon": 5}, r"^balancer\.horizon: unknown key"),
        ({"mode": "resize", "priority": "newest"}, r"^balancer\.priority: must be one of"),
    ],
)
def test_bad_knobs_one_line_naming_the_field(balancer: dict, message: str):
    with pytest.raises(ConfigError, match=message) as error:
        from_dict(RunConfig, {"balancer": balancer})
    assert "\n" not in str(error.value)


def test_run_config_passes_the_balancer_to_the_plugin():
    run = from_dict(RunConfig, {"balancer": {"mode": "semi", "every": 4}})
    assert run.plugin_config().balancer == BalancerConfig(mode="semi", every=4)


@pytest.mark.parametrize(
    ("mode", "parallel", "plan", "message"),
    [
        ("detect", {"tp": 1}, {}, r"needs parallel\.tp > 1, got 1"),
        ("replan", {"tp": 2, "pp": 2}, {}, r"pipeline stages \(parallel\.pp 2\); use semi"),
        ("semi", {"tp": 2, "pp": 2, "zero_stage": 1, "precision": "bf16"}, {}, r"zero_stage 1"),
        ("semi", {"tp": 2, "zero_stage": 1, "precision": "bf16"}, {}, r"parallel\.zero_stage 1"),
        ("replan", {"tp": 2}, {"model_spec": "fx"}, r"plan\.model_spec fx is not supported"),
    ],
)
def test_layouts_the_mode_cannot_run(mode: str, parallel: dict, plan: dict, message: str):
    config = HeteroConfig(
        parallel=ParallelConfig(**parallel),
        plan=PlanConfig(**plan),
        balancer=BalancerConfig(mode=mode),  # type: ignore[arg-type]
    )
    with pytest.raises(ConfigError, match=r"^balancer\.mode: " + mode + ".*" + message):
        check_balancer(config)


def test_accepted_layouts():
    check_balancer(HeteroConfig())  # none: anything goes
    detect = HeteroConfig(
        parallel=ParallelConfig(tp=2, pp=2), balancer=BalancerConfig(mode="detect")
    )
    check_balancer(detect)  # the detector alone runs under pipeline parallelism
    assert not needs_resizable(detect)
    replan = HeteroConfig(parallel=ParallelConfig(tp=2), balancer=BalancerConfig(mode="replan"))
    check_balancer(replan)
    assert needs_resizable(replan)
    # in-layer ops: any DP/PP layout, resizable layers (semi with pp > 1: in-layer actions only)
    for mode in ("resize", "migrate", "semi"):
        config = HeteroConfig(
            parallel=ParallelConfig(tp=2, pp=2),
            balancer=BalancerConfig(mode=mode),  # type: ignore[arg-type]
        )
        check_balancer(config)
        assert needs_resizable(config)
    assert from_dict(RunConfig, {"balancer": {"mode": "migrate"}}).balancer.mode == "migrate"


def test_declared_speeds_per_position():
    assert declared_speeds([1.0, 0.5, 1.0, 0.25], 2) == (1.0, 0.25)
    assert declared_speeds([2.0, 2.0], 2) == (1.0, 1.0)
