"""The variants of ``bench pipeline`` on one rank: a plugin, its boosted model and optimizer.

``Runner`` steps one variant (``bench.pipeline_worker`` and ``bench.pipeline_split`` build
them); ``InFlightMeter`` measures a stock schedule's peak activation bytes as
``KFKBSchedule`` does; ``gather_rows`` all-gathers one row of floats per rank.
"""

from __future__ import annotations

import contextlib
import gc
import io
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from colossalai.booster import Booster

from colossal_hetero.bench.measure import text_batch
from colossal_hetero.bench.pipeline_model import network_config
from colossal_hetero.bench.pipeline_stretch import Stretch
from colossal_hetero.compat.attention import keep_gpt2_causal
from colossal_hetero.config.schema import EmulationConfig, HeteroConfig, ModelConfig
from colossal_hetero.emulation import CollectiveInterceptor, build_interceptor
from colossal_hetero.models import build_model, loss_from_outputs
from colossal_hetero.pipeline.profile import (
    predict_from_records,
    record_from_vector,
    vector_width,
)
from colossal_hetero.pipeline.schedule import KFKBSchedule
from colossal_hetero.utils.device import collective_device

WARM_SEED = 10**6
"""Batch seed of each variant's unrecorded first step (rounds use their global number)."""

NO_ROUND = -1
"""The round a model-mode runner's links read outside the rounds (warm-up steps, stage-time
probes, split trials): before the first, so no preemption of the trace is active."""


class InFlightMeter:
    """Peak activation bytes of a stock (Colossal-AI) schedule, measured like ``KFKBSchedule``
    does: bytes autograd saves in each ``forward_step`` (parameters excluded, a storage once),
    held from that forward to the micro-batch's ``backward_step`` (which frees them, FIFO)."""

    def __init__(self, schedule: Any, model: Any) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: list[int] = []
        self.peak_bytes = 0
        self.busy_s = 0.0
        """Wall seconds in forward_step and backward_step so far: the stage's own passes."""
        forward, backward = schedule.forward_step, schedule.backward_step

        def forward_step(*args: Any, **kwargs: Any) -> Any:
            seen: set[int] = set()
            total = 0
            started = time.perf_counter()

            def pack(t: torch.Tensor) -> torch.Tensor:
                nonlocal total
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self._params and ptr not in seen:
                    seen.add(ptr)
                    total += t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = forward(*args, **kwargs)
            self.busy_s += time.perf_counter() - started
            self.live.append(total)
            self.peak_bytes = max(self.peak_bytes, sum(self.live))
            return out

        def backward_step(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = backward(*args, **kwargs)
            self.busy_s += time.perf_counter() - started
            if self.live:
                self.live.pop(0)
            return out

        schedule.forward_step, schedule.backward_step = forward_step, backward_step

    def take_peak(self) -> int:
        peak, self.peak_bytes, self.live = self.peak_bytes, 0, []
        return peak


class Runner:
    """One variant: a plugin, its boosted model and optimizer, stepped with a batch on demand."""

    def __init__(self, name: str, plugin: Any, model_cfg: ModelConfig, spec: dict[str, Any]):
        self.name, self.plugin, self.spec = name, plugin, spec
        torch.manual_seed(0)
        model = build_model(model_cfg)
        keep_gpt2_causal(model)  # every variant computes the same causal model
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.booster = Booster(plugin=plugin)
        # Each variant's plugin prints its plan on rank 0 as it boosts (a user's one plugin,
        # once); the bench reports splits and widths itself (its table, the JSON), so its ~10
        # builds a layout would bury the console in the same lines.
        with contextlib.redirect_stdout(io.StringIO()):
            self.model, self.optimizer, self.criterion, _, _ = self.booster.boost(
                model, optimizer, loss_from_outputs
            )
        engine = getattr(plugin, "engine", plugin)
        self.schedule = engine.scheduler
        self.kfkb = isinstance(self.schedule, KFKBSchedule)
        self.meter = None if self.kfkb else InFlightMeter(self.schedule, self.model)
        self.blocks = list(self.model.unwrap().transformer.h)
        self.stretch: Stretch | None = None
        """Set on the slowed stage's ranks for the variants of phase (c)."""
        self.steps = 0
        """Steps run so far (a first step pays lazy initialisation)."""
        self.links, self._own_links = _model_links(plugin, spec)

    def follow_rounds(self, running_round: Callable[[], int]) -> None:
        """Model mode: read the links' preemption trace at ``running_round()`` (the round the
        bench is in), as the shaped launcher's tenant follows reported rounds; else a no-op."""
        if self.links is not None:
            self.links.network_step = running_round

    def close(self) -> None:
        """Close the plugin (ours: its seam and controllers) and this runner's own links."""
        close = getattr(self.plugin, "close", None)
        if close is not None:
            close()
        if self._own_links:
            assert self.links is not None
            self.links.uninstall()

    @property
    def k(self) -> int:
        return int(self.schedule.k) if self.kfkb else 1

    def step(self, seed: int) -> list[float]:
        """One training step; this rank's row (``pipeline_model.ROW``), not yet gathered."""
        batch = text_batch(self.spec["batch_size"], self.spec["seq_len"], seed)
        slept = 0.0 if self.stretch is None else self.stretch.slept_s
        gc.collect(1)  # the young garbage of what ran before, untimed (see collector_paused)
        dist.barrier()
        own = self.links if self._own_links else None  # stock in model mode: time it here
        if own is not None:
            own.begin_step(self.steps)
        with collector_paused():
            started = time.perf_counter()
            self.booster.execute_pipeline(iter([batch]), self.model, self.criterion, self.optimizer)
            piped = time.perf_counter()
            k = self.k  # the k this step ran: ada decides early in a step (before_step)
            self.optimizer.step()
            self.optimizer.zero_grad()
            ended = time.perf_counter()
        if own is not None:
            own.end_step()
        if self.kfkb:
            peak = self.schedule.last_stats.activation_bytes * self.schedule.peak_saved
        else:
            assert self.meter is not None
            peak = self.meter.take_peak()
        if self.stretch is not None:
            slept = self.stretch.slept_s - slept
        self.steps += 1
        return [ended - started, piped - started, float(k), float(peak), slept]

    def prediction(self, k: int) -> tuple[float, float]:
        """(simulated, measured) seconds of the last step's schedule, run with ``k`` (ada may
        have retuned since), from every rank's ``last_record``
        (``pipeline.profile.predict_from_records``; one all_gather)."""
        m = self.spec["m"]
        rows = gather_rows(self.schedule.last_record.to_vector(m))
        records = [record_from_vector(row, m) for row in rows]
        assert len(rows[0]) == vector_width(m)
        found = predict_from_records(records, m, k)
        return found.predicted_s, found.measured_s


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's automatic garbage collection off inside (as it was before, after).

    A timed step runs without it: a collection that fell inside a step cost that step what the
    collector took, on one rank at a random point, and inside a stretched block pass the
    emulated device multiplied its CPU time by its base (6, or 12 on phase (c)'s slowed
    device). Instrumented (session 19, PP=2 x TP=2 ``--quick``), each rank ran 12 full
    collections of 0.3-1.9 s: the outlier rounds of every variant. Each step first collects
    the young generations, untimed; :func:`freeze_built` keeps the rest cheap."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class CollectorLog:
    """Python's garbage collections on this rank while installed (``gc.callbacks``): how many
    and their wall seconds, per generation, and the longest (timed steps run none:
    :func:`collector_paused`)."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest_s = 0.0
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        generation = info["generation"]
        self.collections[generation] += 1
        self.seconds[generation] += took
        self.longest_s = max(self.longest_s, took)

    def install(self) -> CollectorLog:
        gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        gc.callbacks.remove(self._callback)

    def by_rank(self) -> list[dict[str, Any]]:
        """Every rank's record (``collections``, ``seconds`` per generation, ``longest_s``), in
        rank order: one all_gather on the world."""
        rows = gather_rows([*map(float, self.collections), *self.seconds, self.longest_s])
        return [
            {"collections": [int(c) for c in row[:3]], "seconds": row[3:6], "longest_s": row[6]}
            for row in rows
        ]


def freeze_built() -> None:
    """Collect, then move every object alive now (the variants built so far: models,
    optimizers, plugins) out of the collector's sight (``gc.freeze``), so a full collection
    later walks only what the steps allocated since. ``gc.unfreeze`` before the variants are
    dropped, or their cycles outlive them."""
    gc.collect()
    gc.freeze()


def _model_links(plugin: Any, spec: dict[str, Any]) -> tuple[CollectiveInterceptor | None, bool]:
    """Model mode: the interceptor whose network model every collective of this variant runs
    on, and whether the runner owns it. Ours: the plugin's (its seam times each step, its
    config carries the bench's links: ``pipeline_model.network_config``); stock Colossal-AI
    has none, so it gets its own on the same links, opened around each step by
    :meth:`Runner.step`, or it would run on free links beside ours. Both read the trace at
    :data:`NO_ROUND` until :meth:`Runner.follow_rounds`. Shaped links: (None, False)."""
    if spec["network_mode"] != "model":
        return None, False
    links = getattr(plugin, "timer", None)
    own = links is None
    if own:
        emulation = EmulationConfig(network=network_config(spec, "model"))
        rank, world = dist.get_rank(), dist.get_world_size()
        links = build_interceptor(emulation, rank, world, collective_device()).install()
    assert isinstance(links, CollectiveInterceptor)
    links.network_step = lambda: NO_ROUND
    return links, own


def gather_rows(row: list[float]) -> list[list[float]]:
    mine = torch.tensor(row, dtype=torch.float64)
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [r.tolist() for r in rows]


def build_plugins(
    configs: dict[str, HeteroConfig | dict[str, Any]],
    device: torch.device,
    workload: tuple[int, int] | None = None,
) -> dict:
    """Each variant's plugin; ``workload`` (global batch, sequence length) for the plugin's
    stage plan (its micro-batch size)."""
    from colossalai.booster.plugin import HybridParallelPlugin

    from colossal_hetero.plugin import HeteroParallelPlugin

    built: dict[str, Any] = {}
    for name, config in configs.items():
        if isinstance(config, dict):  # stock: HybridParallelPlugin keyword arguments
            built[name] = HybridParallelPlugin(**config)
        else:
            built[name] = HeteroParallelPlugin(config, workload=workload)
    return built


def workload_of(spec: dict[str, Any]) -> tuple[int, int]:
    """(global batch, sequence length): what the plugins plan stages and widths for."""
    return spec["batch_size"], spec["seq_len"]
