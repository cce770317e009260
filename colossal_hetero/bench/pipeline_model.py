"""What ``bench pipeline`` runs, as data: the model, the links, the variants' configs. Pure.

Shared by the driver (``bench.pipeline``) and the ranks (``bench.pipeline_worker``); nothing
here touches ``torch.distributed``. ``spec`` is ``BenchSpec.to_dict()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from colossal_hetero.bench.rounds import RoundsPolicy
from colossal_hetero.config.schema import (
    ClusterConfig,
    DeviceSpec,
    EmulationConfig,
    HeteroConfig,
    LinkSpec,
    ModelConfig,
    NetworkEmulationConfig,
    ParallelConfig,
    PlanConfig,
    PreemptionSpec,
    StageTimeSpec,
)
from colossal_hetero.planner.resolve import calibrated
from colossal_hetero.utils.probe import WorldProbe

DEVICE_BASE = 2.5
"""Phase (c)'s emulated devices (``pipeline_stretch.Stretch``, ``dedicated``) are this many
times slower than a core: 4 ranks on 2 cores make a block's wall time up to about twice its CPU
time, and the base absorbs that (``BenchSpec.device_base``)."""

PHASE_SHARES = {"a": 25.0, "b": 81.0, "c": 98.0}
"""Each phase's weight in a ``--quick`` layout's time left (seconds its rounds took in both
layouts of session 14's idle ``--quick`` runs)."""
QUICK_MIN_ROUNDS = {"a": 3, "b": 3, "c": 2}
"""Rounds a ``--quick`` phase runs whatever its budget (phase b's first 3 are preempted; 4
until session 20, when its trace opened with a free round).
On session 15's host, slower than session 14's, 3 rounds of (c) in both layouts and the fixed
costs (launches, builds, the split trial: 96 s) came to 311 s."""
EXIT_RESERVE_S = 5.0
"""Seconds of a layout's deadline kept for closing the variants and the ranks' exit."""

ROW = ("step", "pipe", "k", "peak_bytes", "stretch_s")
"""One rank's numbers for one step, as all-gathered: seconds of the step and of its
execute_pipeline, the k it ran, peak activation bytes, seconds the half-speed stretch slept."""


def model_config(spec: dict[str, Any]) -> ModelConfig:
    """A small GPT-2 (byte vocabulary, no dropout) sized by the spec."""
    return ModelConfig(
        arch="gpt2",
        hf={
            "n_layer": spec["layers"],
            "n_embd": spec["hidden"],
            "n_head": spec["heads"],
            "n_positions": spec["seq_len"],
            "vocab_size": 256,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    )


def device_speeds(world: int, slow_ranks: Sequence[int], factor: float) -> list[float]:
    """Phase (c)'s device speeds: ``1 / factor`` on ``slow_ranks``, 1 elsewhere."""
    return [1.0 / factor if r in slow_ranks else 1.0 for r in range(world)]


def network_config(spec: dict[str, Any], mode: str) -> NetworkEmulationConfig:
    """Every link at ``rate_gbps`` except the TP pairs inside a stage (``fast_gbps``): the stage
    links carry the pipeline's activations and gradients and are the ones preempted.

    Shaped links get no preemptions here: the launcher runs the tenant trace itself, acting on
    the round numbers the ranks report. The model gets the same trace (:func:`preemptions`) as
    rate preemptions whose steps are those round numbers: the bench sets each variant's
    interceptor to read them at the running round (``CollectiveInterceptor.network_step``)."""
    tp, pp = spec["tp"], spec["pp"]
    links = [
        LinkSpec(ranks=[s * tp + a, s * tp + b], bandwidth_gbps=spec["fast_gbps"])
        for s in range(pp)
        for a in range(tp)
        for b in range(a + 1, tp)
    ]
    shaped = mode == "shaped"
    return NetworkEmulationConfig(
        mode="shaped" if shaped else "model",
        bandwidth_gbps=spec["rate_gbps"],
        links=links,
        preemptions=[] if shaped else preemptions(spec["shares"], spec["target_rank"]),
    )


def preemptions(shares: list[float], target_rank: int) -> list[PreemptionSpec]:
    """Tenant preemptions for each run of equal shares below 1 (round numbers as steps)."""
    specs, i = [], 0
    while i < len(shares):
        j = i
        while j < len(shares) and shares[j] == shares[i]:
            j += 1
        if shares[i] < 1.0:
            specs.append(
                PreemptionSpec(
                    factor=shares[i], start_step=i, end_step=j, ranks=[target_rank], kind="tenant"
                )
            )
        i = j
    return specs


def with_device_model(config: HeteroConfig, measured: dict[str, float] | None) -> HeteroConfig:
    """``config`` with the device model measured once for the layout (``utils.probe.WorldProbe``
    fields; ``planner.resolve.calibrated``), as a user writes what ``colossal-hetero profile``
    measured into ``plan``; None: as it is (the plugin then measures at every build, ~2-6 s
    each on the bench's shaped links, a minute of ``--quick`` over phase (c)'s builds)."""
    if measured is None:
        return config
    return calibrated(config, WorldProbe(**measured))


def build_configs(
    spec: dict[str, Any],
    split: str,
    device: Any,
    ada_budget_mib: float | None = None,
    layers: Sequence[int] | None = None,
) -> tuple[ModelConfig, dict[str, Any]]:
    """The model and each variant's config for one split (``"equal"`` or ``"slow"``).

    ``stock`` (equal split only) is HybridParallelPlugin keyword arguments with Colossal-AI's
    even split; the others are HeteroConfigs with the planned split (``layers`` overrides
    it). On equal devices they run ``plan.mode: even``; on phase (c)'s devices (``slow``) they
    are told each device's speed (``cluster.devices``) with ``plan.mode: auto``, so the plugin
    plans every stage's tensor-parallel widths for its devices (``planner.stage_widths``;
    uneven on a stage with the half-speed device) on the configured split. A ``slow`` set whose
    spec carries ``stage_times`` (``[[block_s, fixed_s], ...]``, measured) and no ``layers``
    leaves the split to the plugin: ``plan.stage_times``, as a user configures it."""
    from colossal_hetero.plugin.engine import engine_kwargs

    times = spec.get("stage_times") if split == "slow" and layers is None else None
    layers = [] if times else list(spec["splits"][split] if layers is None else layers)
    network = network_config(spec, spec["network_mode"])
    emulation = EmulationConfig(network=network)
    world = spec["pp"] * spec["tp"]
    speeds = device_speeds(world, spec["slow_ranks"], spec["slow_factor"])
    cluster = ClusterConfig(devices=[DeviceSpec(speed=s) for s in speeds])
    measured = [StageTimeSpec(block_s=b, fixed_s=f) for b, f in times or ()]
    planned = PlanConfig(mode="auto", stage_times=measured)
    planned = planned if split == "slow" else PlanConfig(mode="even")

    def hetero(
        schedule: str, k: int = 1, budget: float | None = None, shares: bool = False
    ) -> HeteroConfig:
        parallel = ParallelConfig(
            pp_link_shares=shares,
            tp=spec["tp"],
            pp=spec["pp"],
            num_microbatches=spec["m"],
            pp_schedule=schedule,  # type: ignore[arg-type]
            pp_k=k,
            pp_retune_every=spec["retune_every"],
            pp_memory_budget_mib=budget,
            num_layers_per_stage=layers,
        )
        if split != "slow":
            return HeteroConfig(parallel=parallel, emulation=emulation, plan=planned)
        config = HeteroConfig(parallel=parallel, emulation=emulation, plan=planned, cluster=cluster)
        return with_device_model(config, spec.get("device_model"))

    configs: dict[str, Any] = {}
    if split == "equal":
        even = HeteroConfig(
            parallel=ParallelConfig(tp=spec["tp"], pp=spec["pp"], num_microbatches=spec["m"])
        )
        configs["stock"] = engine_kwargs(even, device)
    if split == "slow":  # for equal stages the planned split is the even one: that is stock
        configs["planned_1f1b"] = hetero("1f1b")
    for k in spec["ks"]:
        configs[f"k{k}"] = hetero("kfkb", k)
    if split == "equal" and spec.get("link_shares_variant", False):
        configs["ada_link_shares"] = hetero("ada_kfkb", 1, ada_budget_mib, shares=True)
    configs["ada"] = hetero("ada_kfkb", 1, ada_budget_mib)
    return model_config(spec), configs


def _per_stage(
    rows: Sequence[Sequence[float]], layout: Sequence[int], pp: int, field: str
) -> list[float]:
    col = ROW.index(field)
    return [max(r[col] for r, s in zip(rows, layout, strict=True) if s == st) for st in range(pp)]


def stage_peaks(rows: Sequence[Sequence[float]], layout: Sequence[int], pp: int) -> list[float]:
    """Each stage's peak activation bytes (its largest rank's)."""
    return _per_stage(rows, layout, pp, "peak_bytes")


def phase_policy(spec: dict[str, Any], phase: str, now: float) -> RoundsPolicy:
    """How many rounds phase ``phase`` runs: the planned ``rounds``; with a ``deadline``
    (``time.time()``, ``--quick``) at most those, stopping once the next round would end past
    the phase's share (:data:`PHASE_SHARES`, among the phases from this one on) of the time
    left at ``now``, less :data:`EXIT_RESERVE_S`, but not before :data:`QUICK_MIN_ROUNDS`.
    No stop on convergence: every phase's figures need their rounds."""
    planned = spec["phases"][phase]
    rounds, warmup = planned["rounds"], planned["warmup"]
    deadline = float(spec.get("deadline", 0.0))
    if not deadline:
        return RoundsPolicy(warmup, rounds, rounds, budget_s=1e9, target_half_width=0.0)
    left = [p for p in PHASE_SHARES if p >= phase]
    share = PHASE_SHARES[phase] / sum(PHASE_SHARES[p] for p in left)
    budget = max(0.0, (deadline - EXIT_RESERVE_S - now) * share)
    least = min(rounds, QUICK_MIN_ROUNDS[phase])
    return RoundsPolicy(warmup, least, rounds, budget_s=budget, target_half_width=0.0, project=True)
