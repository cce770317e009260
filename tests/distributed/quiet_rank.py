"""A bench rank function and argument type whose module imports Colossal-AI at import time
(as the benches' modules and their case objects do), for test_bench_spawn_quiet.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colossalai.booster.plugin import HybridParallelPlugin  # noqa: F401  (import-time notices)


@dataclass(frozen=True)
class Label:
    text: str


def rank_name(rank: int, world_size: int, device: Any, label: Label) -> str:
    return f"{label.text}{rank}/{world_size}"
