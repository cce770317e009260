"""The booster plugin and process start-up."""

from colossal_hetero.plugin.hetero_plugin import HeteroParallelPlugin
from colossal_hetero.plugin.launch import init_distributed, prepare_device

__all__ = ["HeteroParallelPlugin", "init_distributed", "prepare_device"]
