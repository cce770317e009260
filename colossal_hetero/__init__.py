"""colossal_hetero: Colossal-AI training on heterogeneous and shared clusters.

Public API::

    from colossal_hetero import HeteroConfig, HeteroParallelPlugin, load_config
    booster = Booster(plugin=HeteroParallelPlugin(HeteroConfig(...)))
"""

from colossal_hetero.config import HeteroConfig, RunConfig, load_config

__version__ = "0.1.0"

__all__ = ["HeteroConfig", "HeteroParallelPlugin", "RunConfig", "load_config", "init_distributed"]


def __getattr__(name: str):  # the plugin imports colossalai: load it only when asked for
    if name in ("HeteroParallelPlugin", "init_distributed"):
        from colossal_hetero import plugin

        return getattr(plugin, name)
    raise AttributeError(name)
