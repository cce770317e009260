"""The optimizer stepped per gradient group (moe/split_step.py) equals one step over all.

Reference: the same optimizer stepped once over every parameter (Colossal-AI's bf16 wrapper
with fp32 master weights, and a plain fp32 optimizer), on copies with identical weights and
gradients. AdamW and SGD update each element from its own gradient and state, so the split
steps must give bit-identical weights and state (``torch.equal``)."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from colossalai.amp.naive_amp.mixed_precision_optimizer import MixedPrecisionOptimizer
from colossalai.interface import OptimizerWrapper

from colossal_hetero.moe.comm import MoeComm
from colossal_hetero.moe.split_step import (
    flush_then_step,
    hidden_grads,
    restricted,
    splittable,
)


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 4), (4,), (6, 3), (5,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _wrapped(params: list[torch.nn.Parameter], precision: str, kind: str) -> OptimizerWrapper:
    inner: torch.optim.Optimizer
    if kind == "adamw":
        inner = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01)
    else:
        inner = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if precision == "bf16":
        return MixedPrecisionOptimizer(inner, precision="bf16")
    return OptimizerWrapper(inner)


def _set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_split_steps_equal_one_step(precision: str, kind: str) -> None:
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    whole, split = _params(dtype), _params(dtype)
    opt_whole, opt_split = _wrapped(whole, precision, kind), _wrapped(split, precision, kind)
    assert splittable(opt_split)
    first = [split[0], split[2]]  # a group reduced early (not a prefix: order does not matter)
    for step in range(3):
        _set_grads(whole, step)
        _set_grads(split, step)
        opt_whole.step()
        with restricted(opt_split, first, keep=True):
            type(opt_split).step(opt_split)
        with hidden_grads(opt_split, first):
            opt_split.step()
        opt_whole.zero_grad()
        opt_split.zero_grad()
        for a, b in zip(whole, split, strict=True):
            assert torch.equal(a, b)
    groups = [g["params"] for g in opt_split.optim.param_groups]
    assert [len(g) for g in groups] == [len(whole)]  # restored after each block
    state_whole, state_split = opt_whole.optim.state, opt_split.optim.state
    for mw, ms in zip(opt_whole.optim.param_groups[0]["params"], groups[0], strict=True):
        for key, value in state_whole[mw].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_split[ms][key]))


def test_splittable_refuses_global_updates() -> None:
    scaled = MixedPrecisionOptimizer(torch.optim.AdamW(_params(torch.bfloat16)), precision="bf16")
    assert splittable(scaled)
    scaled.mixed_precision = object()  # type: ignore[assignment]  # fp16's loss scaler (any other)
    assert not splittable(scaled)
    clipped = OptimizerWrapper(torch.optim.AdamW(_params(torch.float32)))
    clipped.max_norm = 1.0  # type: ignore[attr-defined]
    assert not splittable(clipped)

    class Custom(torch.optim.AdamW):  # a subclass may update from more than its own state
        pass

    assert not splittable(OptimizerWrapper(Custom(_params(torch.float32))))
    assert not splittable(torch.optim.LBFGS(_params(torch.float32)))
    assert splittable(torch.optim.AdamW(_params(torch.float32)))


def _with_grads(optim: torch.optim.Optimizer) -> list[int]:
    """Per group: how many parameters a step would update (those with a gradient)."""
    return [sum(p.grad is not None for p in g["params"]) for g in optim.param_groups]


class _FakeReducer:
    """Chunks on the wire with given launch times; a wait finishes the oldest."""

    def __init__(self, params: list[torch.nn.Parameter], launches: list[float], log: list):
        self.params, self.log = params, log
        self.inflight = deque(launches)
        self.touched = True

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params)

    @property
    def reduced(self) -> bool:
        return not self.inflight

    def launch_rest(self) -> None:
        pass

    def oldest_launch(self) -> float | None:
        return self.inflight[0] if self.inflight else None

    def wait_oldest(self) -> None:
        self.log.append(("wait", self.inflight.popleft()))

    def wait_all(self) -> None:
        assert not self.inflight


def test_flush_then_step_steps_a_reduced_group_while_the_other_is_on_the_wire() -> None:
    params = _params(torch.float32)
    reference = _params(torch.float32)
    opt, ref = _wrapped(params, "fp32", "adamw"), _wrapped(reference, "fp32", "adamw")
    log: list = []
    comm = MoeComm()
    expert = _FakeReducer(params[:2], [1.0, 2.0], log)
    dense = _FakeReducer(params[2:], [3.0], log)
    comm.attach({"dense": dense, "expert": expert})  # type: ignore[dict-item]
    seam_calls = []

    def seam_step() -> None:  # the instance's step, as the step seam wraps it
        log.append(("final", _with_grads(opt.optim)))
        opt.optim.step()
        seam_calls.append(1)

    opt.step = flush_then_step(opt, seam_step, comm)  # type: ignore[method-assign]
    opt.optim.register_step_pre_hook(lambda o, *_: log.append(("optim", _with_grads(o))))
    _set_grads(params, 0)
    _set_grads(reference, 0)
    opt.step()
    ref.step()
    # The expert group is stepped after its last chunk, before the dense chunk is waited.
    assert log == [
        ("wait", 1.0),
        ("wait", 2.0),
        ("optim", [2]),
        ("wait", 3.0),
        ("final", [2]),  # the whole group, the expert gradients hidden
        ("optim", [2]),
    ]
    assert [row[0] for row in comm.optim_steps] == ["expert"]
    assert seam_calls == [1]
    assert [len(g["params"]) for g in opt.optim.param_groups] == [4]
    for a, b in zip(params, reference, strict=True):
        assert torch.equal(a, b)


def test_a_group_reduced_during_backward_is_stepped_before_the_flush_waits() -> None:
    params = _params(torch.float32)
    opt = _wrapped(params, "fp32", "sgd")
    log: list = []
    comm = MoeComm()
    expert = _FakeReducer(params[:2], [], log)  # its chunks all ended before the flush
    dense = _FakeReducer(params[2:], [3.0], log)
    comm.attach({"dense": dense, "expert": expert})  # type: ignore[dict-item]
    opt.step = flush_then_step(opt, opt.step, comm)  # type: ignore[method-assign]
    opt.optim.register_step_pre_hook(lambda o, *_: log.append(("optim", _with_grads(o))))
    _set_grads(params, 0)
    opt.step()
    assert log == [("optim", [2]), ("wait", 3.0), ("optim", [2])]
