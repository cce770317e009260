"""Time training steps of one model under one plugin, on every rank of a spawned world.

A step's time is the slowest rank's (the step is synchronous); compute time is a rank's time
outside collectives, as the collective interceptor measures it.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from colossalai.booster import Booster

from colossal_hetero.compat.attention import keep_gpt2_causal
from colossal_hetero.config.schema import ModelConfig
from colossal_hetero.data import shard_batch_by_shares, share_loss_scale
from colossal_hetero.emulation import CollectiveInterceptor
from colossal_hetero.emulation.ddp import route_ddp_through_interceptor
from colossal_hetero.models import build_model, loss_from_outputs
from colossal_hetero.plugin.seam import StepSeam


@dataclass(frozen=True, slots=True)
class Measurement:
    """Medians over the timed steps (seconds)."""

    step_time: float
    """Median over steps of the slowest rank's step time."""

    compute_time: list[float]
    """Per rank: median time outside collectives (emulated stretch included)."""

    comm_wait: list[float]
    """Per rank: median time inside collectives."""

    losses: list[float]
    """Training loss per timed step (as seen by rank 0's TP group)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def text_batch(batch_size: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    """A deterministic random byte batch for causal LM timing."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (batch_size, seq_len), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class TrainingRunner:
    """One model boosted by one plugin, stepped on demand, timed by a step seam.

    Several runners live side by side (each plugin has its own process groups and its own
    interceptor; the interceptors share one wrapper layer); their steps are interleaved so
    that every variant sees the same machine load. A HeteroParallelPlugin brings its seam;
    for another plugin (stock Colossal-AI) the runner installs ``timer`` and builds one.
    Call ``close()`` when done.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        plugin: Any,
        timer: CollectiveInterceptor | None = None,
        *,
        batch_size: int,
        seq_len: int,
        device: torch.device,
        shares: list[int] | None = None,
        dp_rank: int = 0,
        emulated: bool = False,
    ) -> None:
        self.device = device
        self.batch_size, self.seq_len = batch_size, seq_len
        model = build_model(model_cfg)
        # Stock Colossal-AI shards GPT-2 into non-causal SDPA attention (compat/attention.py);
        # every variant runs the causal (eager) model so that all compute the same thing.
        keep_gpt2_causal(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.booster = Booster(plugin=plugin)
        self.model, self.optimizer, self.criterion, _, _ = self.booster.boost(
            model, optimizer, loss_from_outputs
        )
        if emulated:  # the stock plugin's DDP must meet the emulated link and ranks too
            route_ddp_through_interceptor(self.model)
        seam: StepSeam | None = getattr(plugin, "seam", None)
        self._owned: CollectiveInterceptor | None = None  # a timer this runner installed
        if seam is None:
            assert timer is not None, "a plugin without a seam needs a timer"
            self._owned = timer.install()
            seam = StepSeam(timer)
            seam.attach(self.model, self.optimizer)  # steps close at optimizer.step(), as ours
        self.seam = seam
        # Samples per data-parallel group: a plan's (made at boost) or the given ones.
        plan = getattr(plugin, "plan", None)
        self.shares = list(plan.group_samples) if plan is not None else shares or [batch_size]
        self.dp_rank = dp_rank
        self.rows: list[list[float]] = []

    def step(
        self, step: int, *, record: bool, batch: dict[str, torch.Tensor] | None = None
    ) -> None:
        """One training step on ``batch`` (the whole global batch; default: a deterministic
        random one); keeps its timing when ``record``.

        Collectives: the model's own, then one all_gather of four numbers (outside the timing).
        """
        if batch is None:
            batch = text_batch(self.batch_size, self.seq_len, step)
        batch = shard_batch_by_shares(batch, self.shares, self.dp_rank)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        scale = share_loss_scale(self.shares, self.dp_rank)
        self.seam.begin_step(step)
        loss = self.criterion(self.model(**batch), batch)
        self.booster.backward(loss * scale, self.optimizer)
        self.optimizer.step()  # closes the step
        self.optimizer.zero_grad()
        timing = self.seam.end_step()
        values = [timing.step_time, timing.compute_time, timing.comm_wait, float(loss)]
        gathered = _gather(values, self.device)
        if record:
            self.rows.append(gathered)

    def close(self) -> None:
        """Detach the timer the runner installed (a plugin's own is the plugin's to close)."""
        if self._owned is not None:
            self.seam.close()
            self._owned.uninstall()

    def measurement(self) -> Measurement:
        """Medians over the recorded steps."""
        return _summarise(self.rows, dist.get_world_size())


def _gather(values: list[float], device: torch.device) -> list[float]:
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return torch.cat(gathered).tolist()


def _summarise(rows: list[list[float]], world_size: int) -> Measurement:
    width = len(rows[0]) // world_size

    def column(rank: int, index: int) -> list[float]:
        return [row[rank * width + index] for row in rows]

    step_times = [max(row[r * width] for r in range(world_size)) for row in rows]
    return Measurement(
        step_time=statistics.median(step_times),
        compute_time=[statistics.median(column(r, 1)) for r in range(world_size)],
        comm_wait=[statistics.median(column(r, 2)) for r in range(world_size)],
        losses=column(0, 3),
    )
