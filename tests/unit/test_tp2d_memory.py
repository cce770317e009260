"""What the 2D layers keep for the backward, single process (q = 1), against hand counts and
the dense ops: the norms keep the normalised input and rstd only, the lean GELU its input
only, and both still equal the dense functions and their gradients. ``saved_by_op`` splits a
graph's bytes by node, summing to ``forward_bytes``'s total."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import NewGELUActivation

from colossal_hetero.bench.tp2d_measure import forward_bytes, saved_by_op
from colossal_hetero.tp2d.gpt2 import lean_activation
from colossal_hetero.tp2d.layers import LayerNorm2D, RMSNorm2D

MESH = SimpleNamespace(q=1, i=0, j=0)  # q = 1: the layers issue no collective
N, H = 6, 16
FLOAT = 4


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64) * 3 + 1
    return x.requires_grad_(), torch.randn(N, H, generator=g, dtype=torch.float64)


def test_norms_keep_normed_and_rstd_and_equal_dense():
    for kind in ("layer", "rms"):
        layer = (LayerNorm2D if kind == "layer" else RMSNorm2D)(
            MESH,  # type: ignore[arg-type]
            [H],
            dtype=torch.float64,
        )
        with torch.no_grad():
            layer.weight.copy_(torch.linspace(0.5, 1.5, H, dtype=torch.float64))
            if layer.bias is not None:
                layer.bias.copy_(torch.linspace(-0.2, 0.2, H, dtype=torch.float64))
        x, g = _inputs(1)
        saved, out = forward_bytes(
            lambda layer=layer, x=x, g=g: (layer(x) * g).sum(), [*layer.parameters(), g]
        )
        # normed [N, H] and rstd [N, 1] in float64 (the gain, and g the test multiplies by, are
        # excluded).
        assert saved == 8 * (N * H + N), kind
        out.backward()
        x_ref = x.detach().clone().requires_grad_()
        w_ref = layer.weight.detach().clone().requires_grad_()
        if kind == "layer":
            assert layer.bias is not None
            b_ref = layer.bias.detach().clone().requires_grad_()
            ref = F.layer_norm(x_ref, (H,), w_ref, b_ref, layer.eps)
        else:
            ref = x_ref * torch.rsqrt(x_ref.pow(2).mean(-1, keepdim=True) + layer.eps) * w_ref
        (ref * g).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer.weight.grad, w_ref.grad, rtol=1e-12, atol=1e-12)
        if kind == "layer":
            torch.testing.assert_close(layer.bias.grad, b_ref.grad, rtol=1e-12, atol=1e-12)


def test_lean_gelu_equals_gelu_new_and_keeps_its_input_only():
    hf = NewGELUActivation()
    lean = lean_activation(hf)
    assert lean is not hf and lean_activation(torch.nn.ReLU()).__class__ is torch.nn.ReLU
    x, g = _inputs(2)
    lean_bytes, lean_out = forward_bytes(lambda: (lean(x) * g).sum(), [g])
    assert lean_bytes == 8 * N * H  # x only
    lean_out.backward()
    assert x.grad is not None
    lean_grad = x.grad.clone()
    x.grad = None
    hf_bytes, hf_out = forward_bytes(lambda: (hf(x) * g).sum(), [g])
    assert hf_bytes >= 4 * 8 * N * H  # x, x^3's input and more: four tensors of x's size
    hf_out.backward()
    torch.testing.assert_close(lean_out, hf_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lean_grad, x.grad, rtol=1e-12, atol=1e-12)


def test_saved_by_op_splits_the_total():
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)

    def forward() -> torch.Tensor:
        t = torch.tanh(x @ w)  # mm keeps x (32 floats) and w (excluded); tanh its result t
        u = t * t.detach().exp()  # keeps the exp only (t's side needs no grad of the exp)
        return (u * t).sum()  # keeps u and t: t is tanh's too

    total, loss = forward_bytes(forward, [w])
    by_op = saved_by_op(loss, [w])
    assert sum(by_op.values()) == total == FLOAT * 4 * 32
    assert by_op["MmBackward0"] == FLOAT * 32
    # t is kept by tanh and the last mul: it goes to the node met first from the loss.
    assert by_op["MulBackward0"] == FLOAT * 3 * 32 and "TanhBackward0" not in by_op
    with pytest.raises(KeyError):
        by_op["SumBackward0"]
