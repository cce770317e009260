"""``emulation.compute: from_cluster``: the declared device speeds become slowdown factors."""

from __future__ import annotations

import pytest
import yaml

from colossal_hetero.config.loader import ConfigError, dump_config, from_dict
from colossal_hetero.config.schema import (
    ClusterConfig,
    DeviceSpec,
    EmulationConfig,
    HeteroConfig,
    RunConfig,
    SlowdownSpec,
)
from colossal_hetero.emulation import SlowdownSchedule


def _run(speeds: list[float] | None, compute: object = "from_cluster") -> RunConfig:
    cluster = {"devices": [{"speed": s} for s in speeds]} if speeds is not None else {}
    return from_dict(RunConfig, {"cluster": cluster, "emulation": {"compute": compute}})


def test_yaml_string_becomes_factors_relative_to_the_fastest_device() -> None:
    config = _run([0.5, 1.0, 0.25, 1.0])
    # Hand values: fastest 1.0, so rank 0 takes 1.0 / 0.5 = 2x and rank 2 1.0 / 0.25 = 4x.
    assert config.emulation.compute == [
        SlowdownSpec(rank=0, factor=2.0),
        SlowdownSpec(rank=2, factor=4.0),
    ]
    schedules = [SlowdownSchedule.from_config(config.emulation, r) for r in range(4)]
    assert [s.factor_at(7) for s in schedules] == [2.0, 1.0, 4.0, 1.0]
    assert config.plugin_config().emulation == config.emulation
    # The resolved list is what a dumped config.yaml holds, and it loads back equal.
    assert "from_cluster" not in dump_config(config)
    assert from_dict(RunConfig, yaml.safe_load(dump_config(config))) == config


def test_speeds_above_one_and_equal_speeds() -> None:
    # Relative to the fastest, not to 1.0: speeds [1.2, 0.6] slow rank 1 by 2, none by 0.5.
    hetero = HeteroConfig(
        cluster=ClusterConfig(devices=[DeviceSpec(speed=1.2), DeviceSpec(speed=0.6)]),
        emulation=EmulationConfig(compute="from_cluster"),
    )
    assert hetero.emulation.slowdowns == [SlowdownSpec(rank=1, factor=2.0)]
    equal = _run([0.5, 0.5])
    assert equal.emulation.compute == [] and not equal.emulation.enabled


def test_explicit_lists_are_kept() -> None:
    config = _run([1.0, 0.5], compute=[{"rank": 0, "factor": 3.0}])
    assert config.emulation.compute == [SlowdownSpec(rank=0, factor=3.0)]


def test_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^emulation\.compute: from_cluster needs cluster\.dev"):
        _run(None)
    with pytest.raises(ValueError, match=r"^emulation\.compute: from_cluster needs cluster\.dev"):
        HeteroConfig(emulation=EmulationConfig(compute="from_cluster"))
    with pytest.raises(ConfigError, match=r"^emulation\.compute: must be one of 'from_cluster'"):
        _run([1.0, 0.5], compute="from_clutser")
    with pytest.raises(ValueError, match=r"^emulation\.compute: from_cluster is resolved"):
        _ = EmulationConfig(compute="from_cluster").slowdowns
