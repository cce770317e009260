"""parallel.pp_schedule and its fields: one-line errors naming the field, and the link model.

The runtime wiring (the schedule installed, ada_kfkb's decisions) is tested on gloo ranks in
tests/distributed/test_kfkb_plugin.py.
"""

from __future__ import annotations

import pytest

from colossal_hetero.config import ConfigError, HeteroConfig, RunConfig, from_dict
from colossal_hetero.pipeline.validate import MIB, budget_bytes, check_budget, check_stage_split
from colossal_hetero.preflight import validate_layout


def _plugin_config(**sections) -> HeteroConfig:
    return from_dict(RunConfig, sections).plugin_config()


@pytest.mark.parametrize(
    ("parallel", "cluster", "message"),
    [
        (
            {"pp": 2, "num_microbatches": 2, "pp_schedule": "kfkb", "pp_k": 3},
            {},
            r"^parallel\.pp_k: 3 is larger than parallel\.num_microbatches \(2\)$",
        ),
        (
            {"pp": 1, "pp_schedule": "ada_kfkb"},
            {},
            r"^parallel\.pp_schedule: ada_kfkb needs pipeline parallelism \(parallel\.pp > 1\)",
        ),
        (
            {"pp": 1, "pp_schedule": "kfkb"},
            {},
            r"^parallel\.pp_schedule: kfkb needs pipeline parallelism",
        ),
        (
            {"pp": 2, "num_microbatches": 4, "pp_schedule": "kfkb", "pp_k": 2},
            {"device": "cuda"},
            r"^parallel\.pp_schedule: kfkb runs on gloo only .*NCCL",
        ),
    ],
)
def test_layout_errors_name_the_field(parallel, cluster, message):
    config = _plugin_config(parallel=parallel, cluster=cluster)
    with pytest.raises(ConfigError, match=message) as error:
        validate_layout(config, world_size=2)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        ({"pp_k": -1}, r"^parallel\.pp_k: must be >= 1, or 0 to plan it, got -1"),
        ({"pp_retune_every": 0}, r"^parallel\.pp_retune_every: must be >= 1, got 0"),
        ({"pp_memory_budget_mib": 0}, r"^parallel\.pp_memory_budget_mib: must be > 0, got 0"),
        ({"pp_schedule": "gpipe"}, r"^parallel\.pp_schedule: "),
    ],
)
def test_field_errors(parallel, message):
    with pytest.raises(ConfigError, match=message):
        _plugin_config(parallel=parallel)


def test_valid_schedules_pass():
    assert validate_layout(_plugin_config(parallel={"pp": 1}), world_size=2) == 2  # 1f1b default
    for schedule, k in (("kfkb", 4), ("ada_kfkb", 1)):
        parallel = {"pp": 2, "num_microbatches": 4, "pp_schedule": schedule, "pp_k": k}
        assert validate_layout(_plugin_config(parallel=parallel), world_size=4) == 2


def test_memory_budget_below_one_microbatch():
    config = _plugin_config(parallel={"pp": 2, "pp_schedule": "ada_kfkb"})
    assert budget_bytes(config) is None
    check_budget(config, 1e15)  # no limit
    config = _plugin_config(
        parallel={"pp": 2, "pp_schedule": "ada_kfkb", "pp_memory_budget_mib": 1}
    )
    assert budget_bytes(config) == MIB
    check_budget(config, MIB)  # exactly one micro-batch fits
    with pytest.raises(ValueError, match=r"^parallel\.pp_memory_budget_mib: 1 MiB is below one"):
        check_budget(config, MIB + 1)


def test_stage_split_errors():
    split = {"pp": 2, "num_layers_per_stage": [1, 2, 1]}
    with pytest.raises(ConfigError, match=r"^parallel\.num_layers_per_stage: 3 entries for 2 st"):
        validate_layout(_plugin_config(parallel=split), world_size=2)
    split = {"pp": 2, "num_layers_per_stage": [0, 4]}
    with pytest.raises(ConfigError, match=r"^parallel\.num_layers_per_stage: every stage needs"):
        validate_layout(_plugin_config(parallel=split), world_size=2)
    parallel = _plugin_config(parallel={"pp": 2, "num_layers_per_stage": [1, 2]}).parallel
    check_stage_split(parallel, 3)
    with pytest.raises(ConfigError, match=r"sums to 3, the model has 4 layers$"):
        check_stage_split(parallel, 4)
