"""The models ``bench tp2d`` trains side by side on one spawned world (4 ranks, tp = 4).

- ``OneDRunner``: a transformers GPT-2 boosted by stock Colossal-AI ``HybridParallelPlugin``
  (tp_size = 4), optionally with its sequence parallelism (``split_gather``);
- ``TwoDRunner``: the same dense model (same seed, same weights) reduced to this rank's blocks
  by ``tp2d.GPT2LM2D`` on a 2 x 2 mesh with given block sizes and device placement.

Both run eager (causal) attention, take the same full batch and compute the same loss.
``timed_step`` runs one training step under a ``CollectiveInterceptor`` (which times it,
counts what it sends, and stretches a slow rank's compute) and returns numbers that every
rank shares.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from colossal_hetero.bench.tp2d_measure import forward_bytes, state_bytes
from colossal_hetero.compat.attention import keep_gpt2_causal
from colossal_hetero.config.schema import EmulationConfig, ModelConfig
from colossal_hetero.emulation import CollectiveInterceptor, SlowdownSchedule
from colossal_hetero.models import build_model
from colossal_hetero.utils.device import is_host_device

Batch = Mapping[str, torch.Tensor]


def text_batch(batch_size: int, seq_len: int, seed: int, vocab: int) -> dict[str, torch.Tensor]:
    """A deterministic random token batch (labels = inputs, as causal LM training)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class OneDRunner:
    """Stock 1D tensor parallelism over the whole world (Colossal-AI HybridParallelPlugin)."""

    def __init__(
        self, model_cfg: ModelConfig, device: torch.device, *, sequence_parallel: bool
    ) -> None:
        from colossalai.booster import Booster
        from colossalai.booster.plugin import HybridParallelPlugin

        from colossal_hetero.models import loss_from_outputs

        self.device = device
        model = build_model(model_cfg)
        keep_gpt2_causal(model)
        plugin = HybridParallelPlugin(
            tp_size=dist.get_world_size(),
            pp_size=1,
            precision="fp32",
            overlap_communication=False,  # CPU: no side streams
            enable_sequence_parallelism=sequence_parallel,
            sequence_parallelism_mode="split_gather" if sequence_parallel else None,
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        self.booster = Booster(plugin=plugin)
        self.model, self.optimizer, _, _, _ = self.booster.boost(
            model, optimizer, loss_from_outputs
        )

    def parameters(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def forward(self, batch: Batch) -> torch.Tensor:
        inputs = {k: v.to(self.device) for k, v in batch.items()}
        return self.model(**inputs).loss  # type: ignore[no-any-return]

    def backward_and_update(self, loss: torch.Tensor) -> None:
        self.booster.backward(loss, self.optimizer)
        self.optimizer.step()
        self.optimizer.zero_grad()


class TwoDRunner:
    """GPT2LM2D on a 2D mesh of the whole world (``placement``: global rank -> (i, j))."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        device: torch.device,
        shares: Any,
        placement: Mapping[int, tuple[int, int]] | None = None,
    ) -> None:
        from colossal_hetero.tp2d import Mesh2D
        from colossal_hetero.tp2d.gpt2 import GPT2LM2D

        self.device = device
        mesh = Mesh2D.build([list(range(dist.get_world_size()))], placement)
        dense = build_model(model_cfg)
        keep_gpt2_causal(dense)
        self.model = GPT2LM2D(dense, mesh, shares).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)

    def parameters(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def forward(self, batch: Batch) -> torch.Tensor:
        ids, labels = batch["input_ids"].to(self.device), batch["labels"].to(self.device)
        return self.model(ids, labels)  # type: ignore[no-any-return]

    def backward_and_update(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def build_dedicated(
    emulation: EmulationConfig, rank: int, world_size: int, device: torch.device
) -> CollectiveInterceptor:
    """An interceptor whose slowed ranks behave like devices with their own compute
    (``stretch="dedicated"``, see ``CollectiveInterceptor``), for this rank's compute
    slowdowns; not installed."""
    if not is_host_device(device):
        raise ValueError("the dedicated-device stretch emulates CPU ranks only")
    interceptor = CollectiveInterceptor(
        rank,
        world_size,
        slowdown=SlowdownSchedule.from_config(emulation, rank),
        device=device,
        stretch="dedicated",
    )
    interceptor.emulation = emulation  # the router compares whole-world configs
    return interceptor


def world_max(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum over the world's ranks (one all_reduce)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


def world_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum over the world's ranks (one all_reduce)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return [float(v) for v in tensor.tolist()]


def timed_step(
    runner: OneDRunner | TwoDRunner, interceptor: CollectiveInterceptor, index: int, batch: Batch
) -> dict[str, float]:
    """One training step timed by ``interceptor``; the same numbers on every rank.

    ``step``: the slowest rank's step time; ``sent_bytes``: payload bytes all ranks handed to
    collectives (``StepTiming.bytes_by_kind`` summed); ``calls``: the most collective calls
    one rank issued; ``loss``. Two all_reduces outside the timed step.
    """
    interceptor.begin_step(index)
    loss = runner.forward(batch)
    runner.backward_and_update(loss)
    timing = interceptor.end_step()
    step, calls, value = world_max(
        [timing.step_time, float(timing.num_collectives), float(loss)], runner.device
    )
    (sent,) = world_sum([float(sum(timing.bytes_by_kind.values()))], runner.device)
    return {"step": step, "sent_bytes": sent, "calls": calls, "loss": value}


def activation_bytes(runner: OneDRunner | TwoDRunner, batch: Batch) -> dict[str, float]:
    """This rank's activation bytes of one forward on ``batch`` (the graph is then dropped:
    no backward, no update) and its state bytes (weights, gradients, AdamW's moments)."""
    params = runner.parameters()
    saved, loss = forward_bytes(lambda: runner.forward(batch), params)
    del loss  # frees the graph and everything it kept
    return {"activation": float(saved), "state": float(state_bytes(params))}
