"""The ``parallel:`` section: the layout (tp, pp, dp), precision, and the pipeline schedule.

Split from ``schema.py`` to keep each config file small; ``schema`` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from colossal_hetero.config.fields import require as _require

Precision = Literal["fp32", "fp16", "bf16"]


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelConfig:
    """The parallel layout. tp * pp * dp must equal the number of ranks."""

    tp: int = 1
    """Tensor-parallel size."""

    tp_mode: Literal["1d", "2d", "auto"] = "1d"
    """How the tp ranks split the model: 1d (Megatron: weights split, activations whole); 2d
    (Optimus/SUMMA on a q x q mesh, tp = q * q: weights and activations split; GPT-2,
    Llama and ViT; docs/tp2d.md); auto (train, check and plan pick 1d or 2d from the whole
    run config, as plan prints; a plugin built directly takes 1d or 2d only)."""

    pp: int = 1
    """Pipeline-parallel size (stages)."""

    dp: int = 0
    """Data-parallel size; 0 means world_size // (tp * pp)."""

    ep: int = 1
    """Expert-parallel size (Mixtral): each expert lives on one of ep ranks, which exchange
    tokens by all-to-all; ep divides dp and the experts (the moe section, docs/moe.md)."""

    zero_stage: Literal[0, 1, 2] = 0
    """ZeRO stage for data parallelism (1 or 2 need precision fp16 or bf16)."""

    precision: Precision = "fp32"
    """Parameter and compute precision."""

    num_microbatches: int = 1
    """Micro-batches per step and data-parallel rank (used when pp > 1); 0: planned, the count
    with the least simulated step time (``colossal-hetero plan`` shows it)."""

    max_norm: float = 0.0
    """Gradient clipping norm; 0 disables clipping."""

    batch_split: Literal["even", "speed"] = "even"
    """How data-parallel groups share each global batch: even, or in proportion to the speed
    of each group's slowest device (cluster.devices), with gradients weighted to match."""

    batch_shares: list[int] = field(default_factory=list)
    """Explicit samples per data-parallel group per step (overrides batch_split); must sum to
    data.global_batch_size."""

    num_layers_per_stage: list[int] = field(default_factory=list)
    """Transformer layers of each pipeline stage, first to last (pp entries >= 1 summing to the
    model's layers); empty: Colossal-AI's even split."""

    pp_schedule: Literal["1f1b", "kfkb", "ada_kfkb"] = "1f1b"
    """Pipeline schedule (pp > 1): Colossal-AI's 1f1b; kfkb, groups of pp_k forwards then pp_k
    backwards; ada_kfkb, kfkb with k retuned every pp_retune_every steps (docs/pipeline.md)."""

    pp_k: int = 1
    """kfkb's group size, and ada_kfkb's first k (1 <= pp_k <= num_microbatches); 0: planned
    with the micro-batch count."""

    pp_retune_every: int = 10
    """ada_kfkb: steps between retunings of k."""

    pp_memory_budget_mib: float | None = None
    """ada_kfkb: MiB each rank may spend on in-flight activations; null: no limit."""

    pp_link_shares: bool = False
    """ada_kfkb with tp > 1: carry each stage-boundary message over the stage's TP links in
    pieces sized by their measured speeds, retuned with k (a link another tenant slows then
    carries less); false: equal pieces. Off by default: the bench measured no gain from it yet
    (docs/pipeline.md, Link shares)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "pp_retune_every"):
            value = getattr(self, name)
            _require(value >= 1, f"{name}", f"must be >= 1, got {value}")
        for name in ("num_microbatches", "pp_k"):  # 0: the stage planner chooses it
            value = getattr(self, name)
            _require(value >= 0, f"{name}", f"must be >= 1, or 0 to plan it, got {value}")
        _require(
            self.num_microbatches > 0 or (not self.batch_shares and self.batch_split == "even"),
            "num_microbatches",
            "0 (planned) needs batch_split even and no batch_shares (one batch per pipeline)",
        )
        _require(self.dp >= 0, "dp", f"must be >= 0 (0 = derive), got {self.dp}")
        _require(
            self.zero_stage == 0 or self.precision != "fp32",
            "zero_stage",
            f"ZeRO stage {self.zero_stage} needs parallel.precision fp16 or bf16, got fp32",
        )
        _require(
            all(share >= 1 for share in self.batch_shares),
            "batch_shares",
            f"every data-parallel group needs at least one sample, got {self.batch_shares}",
        )
        _require(
            not (self.pp > 1 and self.zero_stage > 1),
            "zero_stage",
            "pipeline parallelism (pp > 1) supports ZeRO stage 0 or 1 only",
        )
        _require(self.max_norm >= 0, "max_norm", f"must be >= 0 (0 = off), got {self.max_norm}")
        budget = self.pp_memory_budget_mib
        _require(budget is None or budget > 0, "pp_memory_budget_mib", f"must be > 0, got {budget}")
