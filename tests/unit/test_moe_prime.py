"""``bench moe``'s priming (bench/moe_prime.py): AdamW at learning rate 0 leaves the weights
bit-identical (against a clone; the same step at the real rate changes them), the wrappers'
torch optimizer is found, a primed round runs the variant twice in order, and the summary's
medians by hand."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from colossal_hetero.bench.moe_prime import (
    frozen_lr,
    inner_optimizer,
    primed,
    priming_summary,
    with_cpu,
)


def _trained_step(model: nn.Module, optimizer: Any) -> None:
    loss = model(torch.linspace(-1, 1, 32).view(4, 8)).square().sum()
    loss.backward()
    inner_optimizer(optimizer).step()
    inner_optimizer(optimizer).zero_grad()


def _model_and_adamw() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _trained_step(model, optimizer)  # moments and step counts not zero
    return model, optimizer


def test_frozen_lr_keeps_adamw_weights_exactly() -> None:
    model, optimizer = _model_and_adamw()
    before = [p.detach().clone() for p in model.parameters()]
    with frozen_lr(optimizer):
        _trained_step(model, optimizer)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert [g["lr"] for g in optimizer.param_groups] == [1e-2]
    _trained_step(model, optimizer)  # the real rate moves them: the check above can fail
    assert not all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


class _Wrapper:  # Colossal-AI's OptimizerWrapper keeps ``optim``, DeepSpeed's ``optimizer``
    def __init__(self, name: str, inner: Any) -> None:
        setattr(self, name, inner)


def test_inner_optimizer_through_wrappers() -> None:
    _, adamw = _model_and_adamw()
    assert inner_optimizer(_Wrapper("optimizer", _Wrapper("optim", adamw))) is adamw
    with frozen_lr(_Wrapper("optim", adamw)):
        assert adamw.param_groups[0]["lr"] == 0.0
    assert adamw.param_groups[0]["lr"] == 1e-2
    with pytest.raises(TypeError, match="no torch optimizer"):
        inner_optimizer(_Wrapper("other", adamw))


def test_primed_round_runs_priming_then_timed() -> None:
    model, optimizer = _model_and_adamw()
    calls: list[tuple[int, bool, float]] = []

    def run(index: int, *, warmup: bool) -> dict[str, float]:
        calls.append((index, warmup, optimizer.param_groups[0]["lr"]))
        _trained_step(model, optimizer)
        return {"step": 1.0 + len(calls), "cpu": 0.5, "faults": 7.0, "comm": 0.1}

    step = primed(run, optimizer, model.parameters)
    assert step(0, warmup=True) == {"step": 2.0, "cpu": 0.5, "faults": 7.0, "comm": 0.1}
    values = step(3, warmup=False)
    assert calls == [(0, True, 1e-2), (3, True, 0.0), (3, False, 1e-2)]
    assert values == {
        "step": 4.0,
        "cpu": 0.5,
        "faults": 7.0,
        "comm": 0.1,
        "prime_step": 3.0,
        "prime_cpu": 0.5,
        "prime_faults": 7.0,
    }


def test_primed_refuses_a_priming_that_moves_weights() -> None:
    model, optimizer = _model_and_adamw()

    def run(index: int, *, warmup: bool) -> dict[str, float]:
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # not an optimizer step: lr 0 cannot stop it
        return {"step": 1.0}

    with pytest.raises(RuntimeError, match="changed the weights"):
        primed(run, optimizer, model.parameters)(0, warmup=False)


def test_priming_summary_by_hand() -> None:
    series = {
        "a.step": [3.0, 1.0, 2.0],
        "a.prime_step": [9.0, 5.0, 7.0],
        "a.cpu": [1.0, 2.0, 4.0],
        "a.prime_cpu": [4.0, 6.0, 5.0],
        "b.step": [1.0, 1.0, 1.0],  # not primed: left out
    }
    assert priming_summary(series) == {
        "a": {"prime_step": 7.0, "timed_step": 2.0, "prime_cpu": 5.0, "timed_cpu": 2.0}
    }


def test_with_cpu_adds_cpu_and_faults() -> None:
    @contextmanager
    def scope(index: int) -> Any:
        yield {"index": float(index)}

    with with_cpu(scope)(5) as seen:
        torch.ones(8 << 20).sum()  # 32 MiB, fresh pages
    assert seen["index"] == 5.0
    assert seen["cpu"] > 0.0 and seen["faults"] > 0.0
