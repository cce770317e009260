"""The ``moe`` section of the configuration tree (mixture-of-experts communication).

A part of ``config.schema``, kept in its own module for size; documented in
``docs/config.md`` like every other section. The expert-parallel size itself is
``parallel.ep``; this section says how the gradients of an expert-parallel run are reduced.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from colossal_hetero.config.fields import require as _require


@dataclass(kw_only=True, slots=True, frozen=True)
class MoeConfig:
    """Gradient reduction and expert layout under expert parallelism (parallel.ep > 1; see
    docs/moe.md). Used with parallel.zero_stage 0; with ZeRO, Colossal-AI's own MoE
    optimizer reduces the gradients and this section's reducer settings are unused."""

    chunk_kib: int = 256
    """Target size of one gradient all-reduce chunk, KiB (the largest, with chunk_auto).
    Each gradient group is cut into max(1, group // size) equal chunks, so a chunk holds
    between this size and twice it (no small tail chunk paying a whole all-reduce latency).
    Chunks are fixed by parameter shapes, never by routing, so every rank issues the same
    all-reduces."""

    chunk_auto: bool = False
    """false: chunks of chunk_kib. true: each gradient group's chunk size comes from the
    alpha-beta profile of its all-reduce, measured at boost time (agreed over the world): the
    fewest chunks whose predicted cost, the a2a's wait for the largest chunk included, is
    within 10% of the least, from 16 KiB to chunk_kib, counted as the plan over the group's
    phase runs really cuts them (re-chosen when the dense order is learnt; docs/moe.md, "Chunk
    size")."""

    pipeline_chunks: int = 1
    """a2a/expert pipelining: each MoE block's dispatch and combine all-to-alls are cut into
    this many token ranges (with pipeline_auto: at most this many), one range's experts
    computed while the next range is on the wire (forward and backward). 1: off. Not
    combined with packing."""

    pipeline_auto: bool = True
    """true: after the first training step the number of ranges (1 = off, up to
    pipeline_chunks) is chosen from the measured all-to-all latency and bandwidth and expert
    compute time (docs/moe.md), the same on every rank, and logged; false: always
    pipeline_chunks."""

    fit_gaps: bool = True
    """With priority: a gradient chunk may go between two all-to-alls (also inside the expert
    compute) only if its predicted all-reduce ends before the next all-to-all's expected start,
    learned from recent steps; false: nothing goes from dispatch to combine."""

    max_inflight: int = 2
    """Most gradient chunks on the wire at once, per gradient group."""

    priority: bool = True
    """true: no gradient chunk is launched while an expert all-to-all is open (Lina's
    priority); false: each chunk goes as soon as it is ready (plain bucketed overlap)."""

    placement: list[list[int]] = field(default_factory=list)
    """Experts held by each expert-parallel rank, ``placement[r]`` for rank r of an ep group;
    every expert exactly once. Empty: Colossal-AI's contiguous blocks."""

    packing: bool = False
    """Expert packing: a token whose top-k experts share an expert-parallel rank is sent there
    once, its experts' outputs weighted and summed there, and one row sent back (fewer a2a
    bytes; outputs equal up to the order of that sum)."""

    replace_every: int = 0
    """Speed-aware re-placement: every this many steps, place the experts again from the
    router's measured loads and the ranks' speeds (cluster.devices), moving expert weights and
    optimizer state between steps. 0: never (the placement stays fixed). Runs at every
    parallel.zero_stage (0: fp32, bf16 or fp16; 1 and 2: bf16 or fp16, ZeRO's master slices
    move too); not with parallel.tp > 1. With moe.packing the decision also counts the packed
    a2a sends (measured routing and costs)."""

    max_experts_per_rank: int = 0
    """Most experts one expert-parallel rank may hold after a re-placement; 0: twice the even
    share (num_local_experts / parallel.ep)."""

    log_events: bool = True
    """Keep each step's log of all-to-all and chunk launch/finish times (written as
    ``moe_rank{r}.jsonl`` beside the metrics when the plugin has a metrics folder)."""

    def __post_init__(self) -> None:
        _require(self.chunk_kib >= 1, "chunk_kib", f"must be >= 1, got {self.chunk_kib}")
        _require(self.max_inflight >= 1, "max_inflight", f"must be >= 1, got {self.max_inflight}")
        _require(
            self.pipeline_chunks >= 1,
            "pipeline_chunks",
            f"must be >= 1, got {self.pipeline_chunks}",
        )
        _require(
            self.pipeline_chunks == 1 or not self.packing,
            "pipeline_chunks",
            "pipelining is not combined with moe.packing: set one of them",
        )
        _require(
            self.replace_every >= 0, "replace_every", f"must be >= 0, got {self.replace_every}"
        )
        _require(
            self.max_experts_per_rank >= 0,
            "max_experts_per_rank",
            f"must be >= 0, got {self.max_experts_per_rank}",
        )

    @property
    def chunk_bytes(self) -> int:
        """The chunk size in bytes."""
        return self.chunk_kib * 1024
