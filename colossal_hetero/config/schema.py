"""The configuration tree: nested dataclasses that YAML maps onto, key for key.

Every field's docstring (the string literal under it) is the reference documentation:
``docs/config.md`` is generated from these classes and a test keeps the two in sync.
Field-local checks live in ``__post_init__``; checks that need the world size or the model
live in ``colossal_hetero.preflight``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from colossal_hetero.config.balancer import BalancerConfig
from colossal_hetero.config.collector import CollectorConfig
from colossal_hetero.config.fields import require as _require
from colossal_hetero.config.moe import MoeConfig
from colossal_hetero.config.parallel import ParallelConfig

Arch = Literal["gpt2", "llama", "mixtral", "bert", "vit"]
# The values users write for ``cluster.device``; ``utils/device.py``, the one module that acts on
# a device kind, maps them to devices and backends. Spelled here because the config layer imports
# no torch (the planner runs without it: tests/unit/test_planner_hf.py).
DeviceKind = Literal["auto", "cpu", "cuda"]


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    """Which Hugging Face model to build, initialised locally (nothing is downloaded)."""

    arch: Arch = "gpt2"
    """Model family: gpt2, llama, mixtral (causal LM; mixtral is a mixture of experts), bert
    (masked LM) or vit (image classifier)."""

    hf: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the family's transformers config class (GPT2Config, LlamaConfig,
    MixtralConfig, BertConfig, ViTConfig). Unknown names are errors."""

    init_seed: int = 0
    """Seed of the random initialisation; equal on every rank so shards agree."""


@dataclass(kw_only=True, slots=True, frozen=True)
class DataConfig:
    """The training data. Both sources ship with Python or scikit-learn: no download."""

    dataset: Literal["pydoc_topics", "digits"] = "pydoc_topics"
    """pydoc_topics: byte-level text from CPython's pydoc_data.topics (for gpt2, llama, bert).
    digits: scikit-learn's 8x8 digit images, 10 classes (for vit)."""

    seq_len: int = 64
    """Tokens per sample for text data (bytes, so the vocabulary is 256)."""

    global_batch_size: int = 8
    """Samples per optimizer step, summed over data-parallel ranks and micro-batches."""

    val_fraction: float = 0.1
    """Fraction of the data held out for validation (the tail of the corpus / a fixed split)."""

    seed: int = 0
    """Seed of batch sampling; every rank of a data-parallel group draws the same stream."""

    def __post_init__(self) -> None:
        _require(self.seq_len >= 2, "seq_len", f"must be >= 2, got {self.seq_len}")
        _require(
            self.global_batch_size >= 1,
            "global_batch_size",
            f"must be >= 1, got {self.global_batch_size}",
        )
        _require(
            0.0 < self.val_fraction < 0.5,
            "val_fraction",
            f"must be in (0, 0.5), got {self.val_fraction}",
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class DeviceSpec:
    """One device (one rank) as the planner sees it."""

    speed: float = 1.0
    """Relative compute speed (1.0 = reference device; 0.5 = half as fast)."""

    memory_gib: float = 16.0
    """Memory available for this rank's model state and activations, GiB."""

    bandwidth_gbps: float = 100.0
    """Bandwidth of this device's link, Gbit/s."""

    def __post_init__(self) -> None:
        _require(self.speed > 0, "speed", f"must be > 0, got {self.speed}")
        _require(self.memory_gib > 0, "memory_gib", f"must be > 0, got {self.memory_gib}")
        _require(
            self.bandwidth_gbps > 0, "bandwidth_gbps", f"must be > 0, got {self.bandwidth_gbps}"
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class ClusterConfig:
    """The devices the run uses: their kind and, per rank, speed, memory and bandwidth."""

    device: DeviceKind = "auto"
    """cpu, cuda, or auto (cuda when enough GPUs are visible, else cpu)."""

    devices: list[DeviceSpec] = field(default_factory=list)
    """One entry per rank, in rank order; empty means identical devices."""

    def speeds(self, world_size: int) -> list[float]:
        """Relative speed of every rank (1.0 each when no devices are listed)."""
        if not self.devices:
            return [1.0] * world_size
        return [d.speed for d in self.devices]


@dataclass(kw_only=True, slots=True, frozen=True)
class SlowdownSpec:
    """A compute slowdown of one rank over a range of steps."""

    rank: int
    """Global rank that is slowed down."""

    factor: float
    """Its compute takes `factor` times as long (>= 1)."""

    start_step: int = 0
    """First step (inclusive) of the slowdown."""

    end_step: int | None = None
    """Last step (exclusive); null means until the end of training."""

    def __post_init__(self) -> None:
        _require(self.rank >= 0, "rank", f"must be >= 0, got {self.rank}")
        _require(self.factor >= 1.0, "factor", f"must be >= 1, got {self.factor}")
        _require(self.start_step >= 0, "start_step", f"must be >= 0, got {self.start_step}")
        _require(
            self.end_step is None or self.end_step > self.start_step,
            "end_step",
            f"must be > start_step ({self.start_step}), got {self.end_step}",
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class LinkSpec:
    """The bandwidth and latency of the link between two ranks (both directions)."""

    ranks: list[int]
    """The two global ranks the link joins."""

    bandwidth_gbps: float
    """Link bandwidth, Gbit/s."""

    latency_us: float = 0.0
    """One-way latency, microseconds."""

    reverse_bandwidth_gbps: float | None = None
    """Bandwidth from ranks[1] to ranks[0], Gbit/s, for an asymmetric link; null means the
    same as `bandwidth_gbps`. Shaped mode shapes each direction; model mode's links are
    symmetric and use `bandwidth_gbps` both ways."""

    def __post_init__(self) -> None:
        _require(
            self.reverse_bandwidth_gbps is None or self.reverse_bandwidth_gbps > 0,
            "reverse_bandwidth_gbps",
            f"must be > 0 or null, got {self.reverse_bandwidth_gbps}",
        )
        _require(len(self.ranks) == 2, "ranks", f"must name two ranks, got {self.ranks}")
        _require(
            self.bandwidth_gbps > 0, "bandwidth_gbps", f"must be > 0, got {self.bandwidth_gbps}"
        )
        _require(self.latency_us >= 0, "latency_us", f"must be >= 0, got {self.latency_us}")


@dataclass(kw_only=True, slots=True, frozen=True)
class PreemptionSpec:
    """Bandwidth taken by another tenant over a range of steps."""

    factor: float
    """Fraction of bandwidth left to this job (0 < factor <= 1)."""

    start_step: int = 0
    """First step (inclusive)."""

    end_step: int | None = None
    """Last step (exclusive); null means until the end of training."""

    ranks: list[int] = field(default_factory=list)
    """Links touching any of these ranks are preempted; empty means every link."""

    kind: Literal["rate", "tenant"] = "rate"
    """rate: the links' bandwidth is scaled by `factor` (shaped mode: `tc change` when the job
    reaches `start_step`, undone at `end_step`). tenant: in shaped mode a tenant process pushes
    bulk TCP into these ranks (every rank when empty) through the same links over the steps,
    paced at (1 - factor) of each rank's configured rate; model mode treats it as rate."""

    def __post_init__(self) -> None:
        _require(0 < self.factor <= 1, "factor", f"must be in (0, 1], got {self.factor}")
        _require(
            self.end_step is None or self.end_step > self.start_step,
            "end_step",
            f"must be > start_step ({self.start_step}), got {self.end_step}",
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class NetworkEmulationConfig:
    """The network between ranks: modelled (collectives take at least their modelled time on
    these links) or shaped (real links with these rates, see docs/cpu-and-emulation.md)."""

    mode: Literal["model", "shaped"] = "model"
    """model: the interceptor sleeps each collective's modelled time (no privileges needed).
    shaped: `colossal-hetero train` runs each rank in its own network namespace behind a
    tc-shaped link and the interceptor adds no network time; needs root and `ip`/`tc`, gloo
    (CPU) ranks only."""

    bandwidth_gbps: float | None = None
    """Bandwidth of every link not listed in `links`; null means no network model."""

    latency_us: float = 0.0
    """Latency of every link not listed in `links`, microseconds."""

    links: list[LinkSpec] = field(default_factory=list)
    """Per-link overrides."""

    preemptions: list[PreemptionSpec] = field(default_factory=list)
    """Time-varying bandwidth preemption trace."""

    def __post_init__(self) -> None:
        _require(
            self.bandwidth_gbps is None or self.bandwidth_gbps > 0,
            "bandwidth_gbps",
            f"must be > 0 (null = no network model), got {self.bandwidth_gbps}",
        )
        _require(self.latency_us >= 0, "latency_us", f"must be >= 0, got {self.latency_us}")

    @property
    def enabled(self) -> bool:
        """Whether any link is modelled."""
        return self.bandwidth_gbps is not None or bool(self.links)


@dataclass(kw_only=True, slots=True, frozen=True)
class EmulationConfig:
    """Heterogeneity emulation on one machine. Off (and free) unless something is listed."""

    compute: list[SlowdownSpec] | Literal["from_cluster"] = field(default_factory=list)
    """Per-rank compute slowdowns, constant or on a step schedule; or from_cluster: slow each
    rank by fastest speed / its speed in cluster.devices (the fastest runs at the host's
    speed; slowdowns cannot speed a rank up). The enclosing config resolves from_cluster into
    the list, so a dumped config.yaml shows the factors."""

    network: NetworkEmulationConfig = field(default_factory=NetworkEmulationConfig)
    """Per-link bandwidth, latency and preemption trace."""

    @property
    def enabled(self) -> bool:
        """Whether any compute or network emulation is configured."""
        return bool(self.compute) or self.network.enabled

    @property
    def slowdowns(self) -> list[SlowdownSpec]:
        """The compute slowdowns (``from_cluster`` resolved by HeteroConfig or RunConfig)."""
        if isinstance(self.compute, str):
            raise ValueError(
                "emulation.compute: from_cluster is resolved against cluster.devices; use it "
                "inside a HeteroConfig or RunConfig"
            )
        return self.compute


def _emulation_for(emulation: EmulationConfig, cluster: ClusterConfig) -> EmulationConfig:
    """``emulation`` with ``compute: from_cluster`` replaced by one slowdown per slower device:
    factor ``max(speeds) / speed``, the fastest device unslowed."""
    if emulation.compute != "from_cluster":
        return emulation
    _require(
        bool(cluster.devices),
        "emulation.compute",
        "from_cluster needs cluster.devices (one device with its speed per rank)",
    )
    fastest = max(device.speed for device in cluster.devices)
    slowdowns = [
        SlowdownSpec(rank=rank, factor=fastest / device.speed)
        for rank, device in enumerate(cluster.devices)
        if device.speed < fastest
    ]
    return replace(emulation, compute=slowdowns)


@dataclass(kw_only=True, slots=True, frozen=True)
class OptimizerConfig:
    """The optimizer and learning-rate schedule."""

    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer."""

    lr: float = 1e-3
    """Peak learning rate."""

    weight_decay: float = 0.0
    """Decoupled weight decay (adamw) or L2 (sgd)."""

    warmup_steps: int = 0
    """Linear warm-up steps; the rate then decays by cosine to 10% at the last step."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        _require(
            self.warmup_steps >= 0,
            "warmup_steps",
            f"must be >= 0, got {self.warmup_steps}",
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainConfig:
    """How long to train and how often to validate."""

    steps: int = 100
    """Optimizer steps."""

    eval_every: int = 25
    """Validate every this many steps (and after the last one); 0 disables validation."""

    eval_batches: int = 4
    """Validation batches per evaluation."""

    seed: int = 0
    """Seed of dropout and other run-time randomness."""

    def __post_init__(self) -> None:
        _require(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        _require(self.eval_every >= 0, "eval_every", f"must be >= 0, got {self.eval_every}")
        _require(
            self.eval_batches >= 1 or self.eval_every == 0,
            "eval_batches",
            f"must be >= 1 when validating (eval_every {self.eval_every}), got "
            f"{self.eval_batches}; eval_every: 0 disables validation",
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class LoggingConfig:
    """Where metrics go and how progress is shown."""

    dir: str = "runs/default"
    """Output folder: metrics_rank{r}.jsonl per rank, plot.png, the resolved config.yaml."""

    progress: bool = True
    """Show a rich progress bar on rank 0."""

    plot: bool = True
    """Write plot.png (loss and per-rank step time) at the end."""


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointConfig:
    """Checkpointing through Colossal-AI's checkpoint IO."""

    dir: str | None = None
    """Checkpoint folder; null disables checkpointing. With `parallel.ep > 1` it holds every
    expert once under its Hugging Face name (docs/moe.md): it loads under any expert
    placement and tensor-parallel width (`parallel.tp` shards are gathered on save and sliced
    on load), and its model folder into `MixtralForCausalLM.from_pretrained`."""

    every: int = 0
    """Save every this many steps (and at the end); 0 saves only at the end."""

    resume: bool = False
    """Resume from the newest checkpoint in `dir` if there is one."""


@dataclass(kw_only=True, slots=True, frozen=True)
class StageTimeSpec:
    """Measured seconds of one pipeline stage per micro-batch (forward + backward)."""

    block_s: float
    """One transformer block on this stage's devices (> 0)."""

    fixed_s: float = 0.0
    """The rest of the stage's pass, whatever its block count: embeddings, LM head and loss,
    the schedule's Python (>= 0)."""

    def __post_init__(self) -> None:
        _require(self.block_s > 0, "block_s", f"must be > 0, got {self.block_s}")
        _require(self.fixed_s >= 0, "fixed_s", f"must be >= 0, got {self.fixed_s}")


@dataclass(kw_only=True, slots=True, frozen=True)
class PlanConfig:
    """How tensor-parallel widths and data-parallel shares are chosen (see docs/planner.md)."""

    mode: Literal["auto", "even", "file"] = "auto"
    """auto: run the planner when cluster.devices differ in speed or memory (else even);
    even: stock even split; file: load the plan from `path`."""

    path: str | None = None
    """Plan file (YAML or JSON) written by `colossal-hetero plan`, used when mode is file."""

    alignment: int = 1
    """Widths other than attention heads are multiples of this. Use 64 on GPUs: on an H100 a
    bf16 shard of 1032 columns took as long as one of 1088, 8% longer than 1024 (docs/gpu.md)."""

    max_iters: int = 10
    """Rounds of the search / LP loop."""

    reference_tflops: float | None = None
    """Sustained TFLOP/s of a device with speed 1.0 (`colossal-hetero profile` measures it).
    null: the plugin measures the device model at configure (a matmul and all-reduce probe,
    agreed over the ranks): this FLOP/s, layer_overhead_us, latency_us and a cap on each
    device's bandwidth_gbps; `colossal-hetero plan` then assumes 100 (GPU class)."""

    latency_us: float = 10.0
    """Per-message link latency the cost model assumes, microseconds."""

    grouped_efficiency: float = 0.7
    """Bandwidth fraction grouped (broadcast-based) collectives reach relative to ring ones."""

    layer_overhead_us: float = 0.0
    """Time per layer per forward and backward pass a speed-1.0 device spends whatever its
    share (framework and kernel-launch overhead), microseconds: once per step, or once per
    micro-batch under pipeline parallelism. `colossal-hetero profile` measures a floor (an
    8 x 8 linear); a model's own layers may cost several times that (docs/pipeline.md)."""

    model_spec: Literal["hf", "fx"] = "hf"
    """Where the planner reads the model's layers: hf: from the transformers config; fx: from a
    torch.fx trace of the model (built on the meta device, no weights allocated)."""

    stage_times: list[StageTimeSpec] = field(default_factory=list)
    """Measured per-stage times, one entry per pipeline stage (a probe run, e.g. stock 1F1B on
    the even split): with parallel.pp > 1 and mode auto the stage split balances
    fixed_s + n * block_s over the stages instead of the modelled FLOP/s (docs/pipeline.md,
    "Measured stage times and the split trial"). Empty: split from the modelled speeds."""

    def __post_init__(self) -> None:
        _require(
            self.mode != "file" or self.path is not None,
            "path",
            "plan.mode is file but no path is given",
        )
        _require(self.alignment >= 1, "alignment", f"must be >= 1, got {self.alignment}")
        _require(self.max_iters >= 1, "max_iters", f"must be >= 1, got {self.max_iters}")
        _require(
            self.layer_overhead_us >= 0,
            "layer_overhead_us",
            f"must be >= 0, got {self.layer_overhead_us}",
        )
        _require(
            self.reference_tflops is None or self.reference_tflops > 0,
            "reference_tflops",
            f"must be > 0, got {self.reference_tflops}",
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class HeteroConfig:
    """What the plugin needs: the parallel layout, the cluster and its emulation."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Devices."""

    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    """Heterogeneity emulation (testing and benchmarks)."""

    plan: PlanConfig = field(default_factory=PlanConfig)
    """Planning of uneven shard widths and batch shares."""

    balancer: BalancerConfig = field(default_factory=BalancerConfig)
    """Runtime straggler balancing."""

    moe: MoeConfig = field(default_factory=MoeConfig)
    """Mixture-of-experts gradient reduction (parallel.ep > 1)."""

    gc: CollectorConfig = field(default_factory=CollectorConfig)
    """Python's garbage collection at step boundaries."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "emulation", _emulation_for(self.emulation, self.cluster))
        _check_stage_times(self.plan, self.parallel)


@dataclass(kw_only=True, slots=True, frozen=True)
class RunConfig:
    """A whole training run, as one YAML file describes it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""

    data: DataConfig = field(default_factory=DataConfig)
    """The data."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Devices."""

    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    """Heterogeneity emulation."""

    plan: PlanConfig = field(default_factory=PlanConfig)
    """Planning of uneven shard widths and batch shares."""

    balancer: BalancerConfig = field(default_factory=BalancerConfig)
    """Runtime straggler balancing."""

    moe: MoeConfig = field(default_factory=MoeConfig)
    """Mixture-of-experts gradient reduction (parallel.ep > 1)."""

    gc: CollectorConfig = field(default_factory=CollectorConfig)
    """Python's garbage collection at step boundaries."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps and validation."""

    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and progress."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "emulation", _emulation_for(self.emulation, self.cluster))
        _check_stage_times(self.plan, self.parallel)

    def plugin_config(self) -> HeteroConfig:
        """The part of the run the plugin consumes."""
        return HeteroConfig(
            parallel=self.parallel,
            cluster=self.cluster,
            emulation=self.emulation,
            plan=self.plan,
            balancer=self.balancer,
            moe=self.moe,
            gc=self.gc,
        )


def _check_stage_times(plan: PlanConfig, parallel: ParallelConfig) -> None:
    """``plan.stage_times`` against the layout: one entry per stage of a pipeline that the
    planner splits (pp > 1, mode auto, no configured ``parallel.num_layers_per_stage``)."""
    times = plan.stage_times
    if not times:
        return
    name = "plan.stage_times"
    _require(parallel.pp > 1, name, f"needs parallel.pp > 1, got pp {parallel.pp}")
    _require(
        len(times) == parallel.pp,
        name,
        f"{len(times)} entries for parallel.pp = {parallel.pp} stages (one per stage)",
    )
    _require(plan.mode == "auto", name, f"needs plan.mode auto, got {plan.mode}")
    _require(
        not parallel.num_layers_per_stage,
        name,
        "parallel.num_layers_per_stage fixes the split already; give one of the two",
    )
