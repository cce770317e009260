"""Configuration: one tree of dataclasses, loaded strictly from YAML."""

from colossal_hetero.config.loader import ConfigError, dump_config, from_dict, load_config, to_dict
from colossal_hetero.config.schema import (
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    DeviceSpec,
    EmulationConfig,
    HeteroConfig,
    LinkSpec,
    LoggingConfig,
    ModelConfig,
    NetworkEmulationConfig,
    OptimizerConfig,
    ParallelConfig,
    PreemptionSpec,
    RunConfig,
    SlowdownSpec,
    TrainConfig,
)
from colossal_hetero.config.validate import resolve_dp, validate_layout, validate_run

__all__ = [
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "DeviceSpec",
    "EmulationConfig",
    "HeteroConfig",
    "LinkSpec",
    "LoggingConfig",
    "ModelConfig",
    "NetworkEmulationConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PreemptionSpec",
    "RunConfig",
    "SlowdownSpec",
    "TrainConfig",
    "dump_config",
    "from_dict",
    "load_config",
    "resolve_dp",
    "to_dict",
    "validate_layout",
    "validate_run",
]
