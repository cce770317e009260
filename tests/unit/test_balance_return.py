"""Return of frozen columns (balance/ops/resize.py, ``freeze_on_step(on_return=...)``).

A layer ZERO-resized for a few AdamW steps with its dropped columns frozen, then its op off.
The reference is a dense one: a second parameter trained by a plain torch AdamW (no wrapper)
on the same function, whose dropped columns' weights and state are restored by hand after
each resized step, and restarted by hand (weight and ``exp_avg`` set to 0) just before the
first full step. Both sides run the same non-foreach AdamW arithmetic on the same values, so
they agree bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colossal_hetero.balance.ops.resize import freeze_on_step, resized_linear

N, K = 5, 8
DROPPED = torch.tensor([1, 4, 6])
KEPT = torch.tensor([0, 2, 3, 5, 7])
RESIZED_STEPS, FULL_STEPS = 3, 2


def _adamw(param: nn.Parameter) -> torch.optim.AdamW:
    return torch.optim.AdamW([param], lr=0.05, weight_decay=0.1, foreach=False)


def _loss(weight: torch.Tensor, step: int, resized: bool, tied: bool) -> torch.Tensor:
    x = torch.randn(7, K, generator=torch.Generator().manual_seed(step))
    y = resized_linear(x, weight, None, KEPT) if resized else x @ weight.t()
    loss = y.tanh().square().sum()
    if tied:  # another use of the whole weight (GPT-2's tied embedding): dropped columns too
        loss = loss + weight.sum(0).square().sum()
    return loss


def _wrapped(policy: str, tied: bool) -> torch.Tensor:
    torch.manual_seed(0)
    param = nn.Parameter(torch.randn(N, K))
    optimizer = _adamw(param)
    phase = {"resized": True}

    def targets() -> list[tuple[nn.Parameter, int, torch.Tensor]]:
        return [(param, 1, DROPPED)] if phase["resized"] else []

    freeze_on_step(optimizer, targets, on_return=policy)
    for step in range(RESIZED_STEPS + FULL_STEPS):
        phase["resized"] = step < RESIZED_STEPS
        _loss(param, step, phase["resized"], tied).backward()
        optimizer.step()
        optimizer.zero_grad()
    return param.detach().clone()


def _reference(restart: bool, tied: bool) -> torch.Tensor:
    torch.manual_seed(0)
    param = nn.Parameter(torch.randn(N, K))
    optimizer = _adamw(param)
    _loss(param, 0, True, tied).backward()  # the first step creates the state: zeros there
    frozen = param.detach()[:, DROPPED].clone()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        param[:, DROPPED] = frozen
        for key in ("exp_avg", "exp_avg_sq"):
            optimizer.state[param][key][:, DROPPED] = 0
    for step in range(1, RESIZED_STEPS):
        state = optimizer.state[param]
        saved = [t[:, DROPPED].clone() for t in (state["exp_avg"], state["exp_avg_sq"])]
        _loss(param, step, True, tied).backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            param[:, DROPPED] = frozen
            state["exp_avg"][:, DROPPED], state["exp_avg_sq"][:, DROPPED] = saved
    for step in range(RESIZED_STEPS, RESIZED_STEPS + FULL_STEPS):
        _loss(param, step, False, tied).backward()
        if restart and step == RESIZED_STEPS:
            with torch.no_grad():
                param[:, DROPPED] = 0
                optimizer.state[param]["exp_avg"][:, DROPPED] = 0
        optimizer.step()
        optimizer.zero_grad()
    return param.detach().clone()


def test_zero_restarts_the_returning_columns_as_the_dense_reference():
    got = _wrapped("zero", tied=False)
    torch.testing.assert_close(got, _reference(restart=True, tied=False), rtol=0, atol=0)
    # the policy made a difference: the columns kept their old weights under "keep"
    kept = _wrapped("keep", tied=False)
    torch.testing.assert_close(kept, _reference(restart=False, tied=False), rtol=0, atol=0)
    assert not torch.equal(got[:, DROPPED], kept[:, DROPPED])


def test_columns_used_elsewhere_while_dropped_are_not_restarted():
    got = _wrapped("zero", tied=True)  # a nonzero gradient reached the dropped columns
    torch.testing.assert_close(got, _reference(restart=False, tied=True), rtol=0, atol=0)


def test_a_changed_dropped_set_is_no_return():
    """The kept set re-chosen while the op stays: nothing restarted, whatever moved."""
    torch.manual_seed(0)
    param = nn.Parameter(torch.randn(N, K))
    optimizer = _adamw(param)
    sets = [DROPPED, torch.tensor([0, 1, 2]), torch.tensor([5])]
    index = {"i": 0}
    freeze_on_step(optimizer, lambda: [(param, 1, sets[index["i"]])], on_return="zero")
    for step, cols in enumerate(sets):
        index["i"] = step
        before = param.detach()[:, cols].clone()
        kept = torch.tensor([j for j in range(K) if j not in cols.tolist()])
        resized_linear(torch.randn(7, K), param, None, kept).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert torch.equal(param.detach()[:, cols], before)  # frozen, never zeroed
    assert bool(param.detach()[:, DROPPED].ne(0).all())


def test_bad_policy_is_one_value_error():
    param = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="on_return"):
        freeze_on_step(_adamw(param), list, on_return="fade")
