"""HeteroParallelPlugin.resize with data parallelism (torch DDP) and mixed precision.

The move itself is exact: every tensor resize moves (weights, gradients, bf16 working weights,
fp32 master weights, Adam state), gathered to its full size right before and right after the
resize, is bitwise equal. Training then continues:

- fp32 (tp=2 x dp=2, each replica sees different samples) and bf16 with fp32 masters (tp=2 x
  dp=2, and tp=2 alone): training resized before a step and between backward and step equals,
  bitwise, training that stops at the same points, gathers its full state and restarts a fresh
  run at the new widths from it (tests/restart.py): like with like, the same kernels on the
  same shard shapes. A run at other widths throughout is no reference: it sums in another
  order, and Adam (update lr * m / (sqrt(v) + eps)) turns the rounding noise of near-zero
  gradients (GPT-2's key bias has an exactly zero one) into O(lr) weight differences. The
  replicas stay identical (the rebuilt DDP still averages gradients) and the losses fall.
- fp16 (tp=2): the moves are exact and the losses finite.
- refusals: ZeRO raises a ValueError naming ``parallel.zero_stage`` before any collective
  (collectives are patched to fail), widths that differ across ranks raise on every rank and
  move nothing, and mixed precision without the booster's optimizer is refused.
"""

from __future__ import annotations

import math
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from colossalai.booster import Booster

from colossal_hetero.config import HeteroConfig, ModelConfig, ParallelConfig
from colossal_hetero.models import build_model, loss_from_outputs
from colossal_hetero.plugin import HeteroParallelPlugin, prepare_device
from colossal_hetero.policies import resizable_policy
from tests.dist_utils import run_distributed
from tests.restart import gather_full, load_full
from tests.tiny_models import GPT2, LLAMA

GPT2_A = {"heads": (3, 1), "ffn": (80, 16), "vocab": (200, 56)}
GPT2_B = {"heads": (1, 3), "ffn": (8, 88), "vocab": (56, 200)}
LLAMA_A = {"heads": (2, 4), "ffn": (0, 64), "vocab": (31, 225)}
LLAMA_B = {"heads": (4, 2), "ffn": (40, 24), "vocab": (256, 0)}
GLOBAL_BATCH = 4


def _batch(dp_rank: int, dp: int) -> dict[str, torch.Tensor]:
    """This replica's share of the global batch, the same every step (so the loss falls)."""
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 256, (GLOBAL_BATCH, 1), generator=generator)
    ids = (starts + 37 * torch.arange(16)) % 256
    ids = ids.chunk(dp)[dp_rank]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class _Run:
    """A model boosted by the plugin with resizable TP=2 widths and Adam."""

    def __init__(self, model_cfg: ModelConfig, widths: dict, *, precision: str, zero: int = 0):
        policy = resizable_policy(build_model(model_cfg), widths)
        parallel = ParallelConfig(tp=2, precision=precision, zero_stage=zero)
        self.plugin = HeteroParallelPlugin(HeteroConfig(parallel=parallel), policy=policy)
        model = build_model(model_cfg)
        self.booster = Booster(plugin=self.plugin)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        self.model, self.optimizer, self.criterion, _, _ = self.booster.boost(
            model, optimizer, loss_from_outputs
        )
        self.dp = self.plugin.dp_size
        self.dp_rank = dist.get_rank(self.model.dp_group) if self.dp > 1 else 0

    def backward(self) -> float:
        batch = _batch(self.dp_rank, self.dp)
        loss = self.criterion(self.model(**batch), batch)
        self.booster.backward(loss, self.optimizer)
        return float(loss)

    def finish_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def resize(self, widths: dict) -> None:
        self.plugin.resize(self.model, self.optimizer, widths)

    def close(self) -> None:
        self.plugin.close()


def _gather_all(run: _Run) -> dict[str, Any]:
    """Every tensor resize moves, at full size (see tests/restart.py): collectives over TP."""
    return gather_full(run.model, run.optimizer)


def _assert_bitwise(before: dict, after: dict, what: str) -> None:
    assert before.keys() == after.keys(), (what, sorted(set(before) ^ set(after)))
    for name, tensor in before.items():
        if torch.is_tensor(tensor):
            torch.testing.assert_close(after[name], tensor, rtol=0, atol=0, msg=f"{what} {name}")
        else:
            assert after[name] == tensor, (what, name)


def _check_maps(run: _Run) -> None:
    """The working<->master maps and the optimizer state agree with the resized parameters."""
    optimizer = run.optimizer
    masters = [p for group in optimizer.optim.param_groups for p in group["params"]]
    assert set(map(id, optimizer.optim.state)) <= set(map(id, masters))
    for working, master in optimizer.working_to_master_map.items():
        assert optimizer.master_to_working_map[master] is working
        assert master.dtype == torch.float32 and master.shape == working.shape
        assert torch.equal(working.data, master.data.to(working.dtype))
        for value in optimizer.optim.state.get(master, {}).values():
            assert not value.dim() or value.shape == master.shape


def _resized_training(
    model_cfg: ModelConfig, widths: dict, other: dict, precision: str, steps: int = 4
) -> tuple[list[float], dict]:
    """Train ``steps`` steps: widths -> other before step 2, other -> widths inside step 3.

    Checks that each resize moves every tensor bitwise; returns the losses and final state.
    """
    run = _Run(model_cfg, widths, precision=precision)
    losses = []
    try:
        for step in range(steps):
            if step == steps // 2:  # before the step: weights, masters and Adam state move
                before = _gather_all(run)
                run.resize(other)
                _assert_bitwise(before, _gather_all(run), f"{precision} resize before a step")
            losses.append(run.backward())
            if step == steps - 1:  # between backward and step: the gradients move too
                before = _gather_all(run)
                assert any(name.endswith(".grad") for name in before)
                run.resize(widths)
                _assert_bitwise(before, _gather_all(run), f"{precision} resize inside a step")
            run.finish_step()
        if precision != "fp32":
            _check_maps(run)
        return losses, _gather_all(run)
    finally:
        run.close()


def _plain_training(
    model_cfg: ModelConfig, widths: dict, precision: str, steps: int = 4
) -> tuple[list[float], dict]:
    run = _Run(model_cfg, widths, precision=precision)
    try:
        losses = []
        for _ in range(steps):
            losses.append(run.backward())
            run.finish_step()
        return losses, _gather_all(run)
    finally:
        run.close()


def _assert_replicas_equal(state: dict) -> None:
    """Every rank holds the same full tensors: TP peers gathered them, DP replicas synced."""
    for name, tensor in state.items():
        if torch.is_tensor(tensor):
            reference = tensor.clone()
            dist.broadcast(reference, src=0)
            assert torch.equal(tensor, reference), f"rank {dist.get_rank()} differs: {name}"


def _restarted_training(
    model_cfg: ModelConfig, widths: dict, other: dict, precision: str, steps: int = 4
) -> tuple[list[float], dict]:
    """_resized_training's like-with-like reference: where it resizes, this run stops, gathers
    its full state and restarts a fresh run at the new widths from that state."""
    phases = [(widths, steps // 2), (other, steps - steps // 2), (widths, 0)]
    losses: list[float] = []
    state: dict[str, Any] = {}
    for index, (phase_widths, num_backwards) in enumerate(phases):
        run = _Run(model_cfg, phase_widths, precision=precision)
        try:
            if state:
                load_full(run.model, run.optimizer, state, ("step", "exp_avg", "exp_avg_sq"))
                if index == len(phases) - 1:  # the step whose backward ran at the other widths
                    run.finish_step()
            for number in range(num_backwards):
                losses.append(run.backward())
                if index == 0 or number < num_backwards - 1:
                    run.finish_step()
            state = _gather_all(run)
        finally:
            run.close()
    return losses, state


def _check_fp32_dp() -> None:
    """tp=2 x dp=2: training resized A -> B -> A equals, bitwise, training stopped and
    restarted from its full state at the same widths at the same points."""
    losses, state = _resized_training(GPT2, GPT2_A, GPT2_B, "fp32")
    expected_losses, expected = _restarted_training(GPT2, GPT2_A, GPT2_B, "fp32")
    # Exact: same kernels, same shard shapes, same reduction order (a 2-replica DDP mean is
    # (a + b) / 2, the same whichever bucket carries it).
    assert losses == expected_losses, (losses, expected_losses)
    _assert_bitwise(expected, state, "fp32 resized vs restarted")
    _assert_replicas_equal(state)
    assert losses[-1] < losses[0], losses


def _check_bf16(model_cfg: ModelConfig, widths: dict, other: dict) -> None:
    """bf16 working weights, fp32 masters: resized training equals restarted training bitwise
    (like with like, as _check_fp32_dp), and it learns."""
    losses, state = _resized_training(model_cfg, widths, other, "bf16")
    expected_losses, expected = _restarted_training(model_cfg, widths, other, "bf16")
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < losses[0], losses
    assert losses == expected_losses, (losses, expected_losses)
    _assert_bitwise(expected, state, "bf16 resized vs restarted")
    _assert_replicas_equal(state)


def _check_fp16() -> None:
    """fp16 (loss scaling): resizing before and inside one step moves everything exactly."""
    losses, _ = _resized_training(LLAMA, LLAMA_A, LLAMA_B, "fp16", steps=2)
    assert all(math.isfinite(loss) for loss in losses), losses


def _check_refusals(rank: int) -> None:
    """ZeRO, different widths per rank and AMP without its optimizer raise ValueError."""

    def no_collective(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("resize ran a collective before refusing")

    run = _Run(GPT2, GPT2_A, precision="bf16", zero=1)
    try:
        names = ("all_reduce", "all_gather_into_tensor", "all_gather", "broadcast", "barrier")
        with mock.patch.multiple(dist, **{name: no_collective for name in names}):
            with pytest.raises(ValueError, match="parallel.zero_stage 1"):
                run.resize(GPT2_B)
    finally:
        run.close()

    run = _Run(GPT2, GPT2_A, precision="bf16")
    try:
        run.backward()
        run.finish_step()
        before = _gather_all(run)
        with pytest.raises(ValueError, match="differ across ranks"):
            run.resize(GPT2_B if rank == 0 else GPT2_A)
        with pytest.raises(ValueError, match="booster's optimizer"):
            run.plugin.resize(run.model, None, GPT2_B)
        _assert_bitwise(before, _gather_all(run), "refused resize")
    finally:
        run.close()


def _four_ranks(rank: int, world_size: int, device: torch.device) -> None:
    prepare_device(device)
    _check_fp32_dp()
    _check_bf16(GPT2, GPT2_A, GPT2_B)


def _two_ranks(rank: int, world_size: int, device: torch.device) -> None:
    prepare_device(device)
    _check_bf16(LLAMA, LLAMA_A, LLAMA_B)
    _check_fp16()
    _check_refusals(rank)


@pytest.mark.numerics
@pytest.mark.dist
@pytest.mark.timeout(600)  # a hang guard: ~4 min with four ranks on two busy cores
def test_resize_with_data_parallel_ddp_fp32_and_bf16():
    """tp=2 x dp=2 on four ranks; one spawn, the checks name what failed."""
    run_distributed(_four_ranks, world_size=4)


@pytest.mark.dist
@pytest.mark.timeout(600)  # a hang guard: ~2.5 min on two busy cores
def test_resize_bf16_masters_and_refusals():
    """tp=2 on two ranks: bf16/fp16 masters move exactly; ZeRO and bad widths refused."""
    run_distributed(_two_ranks, world_size=2)
