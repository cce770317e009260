"""Heterogeneity emulation on one machine: slow devices and slow links, by sleeping.

``schedule`` and ``network`` are pure models of an ``EmulationConfig``; ``interceptor`` is the
single place where they act, by wrapping torch.distributed collectives. It also times every
step's compute and communication, so the trainer installs one even with emulation off.
"""

from __future__ import annotations

import os

import torch

from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.schema import EmulationConfig
from colossal_hetero.emulation.collectives import WRAPPED_NAMES
from colossal_hetero.emulation.interceptor import CollectiveInterceptor
from colossal_hetero.emulation.network import NetworkModel
from colossal_hetero.emulation.schedule import SlowdownSchedule
from colossal_hetero.emulation.shaped.topology import SHAPED_ENV
from colossal_hetero.emulation.timing import StepTiming

__all__ = [
    "WRAPPED_NAMES",
    "CollectiveInterceptor",
    "NetworkModel",
    "SlowdownSchedule",
    "StepTiming",
    "build_interceptor",
]


def build_interceptor(
    emulation: EmulationConfig, rank: int, world_size: int, device: torch.device
) -> CollectiveInterceptor:
    """An interceptor (not yet installed) for this rank's part of ``emulation``.

    With emulation off it only times steps: the models it gets are disabled and cost nothing.
    In shaped mode (``emulation.network.mode: shaped``) the real links take the time, so the
    interceptor gets no network model; compute slowdowns still apply. Raises ConfigError
    for shaped mode on ranks that the shaped launcher did not start.
    """
    shaped = emulation.network.mode == "shaped"
    if shaped and SHAPED_ENV not in os.environ:
        raise ConfigError(
            "emulation.network.mode: shaped needs ranks started on shaped links (by "
            "`colossal-hetero train` or `python -m colossal_hetero.emulation.shaped`), not "
            "torchrun; use mode: model under other launchers"
        )
    interceptor = CollectiveInterceptor(
        rank,
        world_size,
        slowdown=SlowdownSchedule.from_config(emulation, rank),
        network=None if shaped else NetworkModel.from_config(emulation.network, world_size),
        device=device,
    )
    interceptor.emulation = emulation
    return interceptor
