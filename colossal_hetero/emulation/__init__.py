"""Heterogeneity emulation on one machine: slow devices and slow links, by sleeping.

``schedule`` and ``network`` are pure models of an ``EmulationConfig``; ``interceptor`` is the
single place where they act, by wrapping torch.distributed collectives. It also times every
step's compute and communication, so the trainer installs one even with emulation off.
"""

from __future__ import annotations

import torch

from colossal_hetero.config.schema import EmulationConfig
from colossal_hetero.emulation.collectives import WRAPPED_NAMES
from colossal_hetero.emulation.interceptor import CollectiveInterceptor
from colossal_hetero.emulation.network import NetworkModel
from colossal_hetero.emulation.schedule import SlowdownSchedule
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
    """
    return CollectiveInterceptor(
        rank,
        world_size,
        slowdown=SlowdownSchedule.from_config(emulation, rank),
        network=NetworkModel.from_config(emulation.network, world_size),
        device=device,
    )
