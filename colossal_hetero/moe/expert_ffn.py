"""The held experts' FFN as one autograd node that overlaps the dispatch's backward a2a.

In backward, a layer's dispatch a2a sends the gradient of the rows its experts received back
to the ranks that own the tokens, and everything before it in the layer waits for it. Autograd
computes an expert's input gradient and its weight gradients in one go, so that a2a went out
only after both. :class:`ExpertsFFN` computes every held expert's FFN (Mixtral's
``w2(silu(w1 x) * w3 x)``, per received piece, as the block does) and in backward:

1. the input gradient of every piece (the rows the reverse a2a carries);
2. launches that a2a asynchronously (:func:`launch`, through the reducers' gate as every a2a);
3. the weight gradients while the rows are on the wire;
4. returns both; the dispatch's own backward (moe/block.py) waits for the launched a2a
   instead of issuing one.

Same arithmetic as autograd's: the forward calls the same functions, the backward the
derivatives autograd uses for them (``mm`` for a linear layer's input and weight, SiLU's
``silu_backward``, products for the gate), one piece at a time; an expert's weight gradient
is the sum over its pieces (autograd adds them too, in its own order). An expert no row
reached gets no gradient (``None``), as without this node: ``mark_idle`` zero-filled it.

Only for experts that are three bias-free ``nn.Linear`` and ``nn.SiLU`` (Hugging Face Mixtral;
:func:`fusable`); tensor-parallel experts (their own collectives) take the block's plain path.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def fusable(block: Any) -> bool:
    """Whether ``block``'s held experts can run as :class:`ExpertsFFN`: each is bias-free
    ``w1``, ``w3``, ``w2`` ``nn.Linear`` (exactly) with ``nn.SiLU``, and no tp split."""
    group = getattr(block, "tp_group", None)
    if group is not None and dist.get_world_size(group) > 1:
        return False
    for e in block.held:
        expert = block.experts[e]
        layers = (expert.w1, expert.w3, expert.w2)
        if any(type(layer) is not nn.Linear or layer.bias is not None for layer in layers):
            return False
        if type(expert.act_fn) is not nn.SiLU:
            return False
    return True


@dataclass
class PendingA2a:
    """An a2a launched asynchronously inside its gate (``stack`` holds the gate open)."""

    stack: ExitStack
    work: Any
    out: torch.Tensor
    sent: torch.Tensor  # kept alive until the transfer ends

    def wait(self) -> torch.Tensor:
        """Wait for the transfer, close the gate (chunks may go), return the received rows."""
        try:
            self.work.wait()
        finally:
            self.stack.close()
        return self.out


def launch(x: torch.Tensor, send: list[int], recv: list[int], block: Any) -> PendingA2a:
    """Rows ``send[d]`` of ``x`` to rank ``d`` of the block's ep group, asynchronously, inside
    one ``MoeComm.a2a_call`` (gated and logged; the call's end is stamped when the transfer
    completes, not when it is waited, so the log holds the transfer alone)."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    stack = ExitStack()
    event = stack.enter_context(block.comm.a2a_call(block.ep_group, x.numel() * x.element_size()))
    try:
        work = dist.all_to_all_single(out, x, recv, send, group=block.ep_group, async_op=True)
        assert work is not None
        event.issued()
        try:
            work.get_future().then(lambda _: event.finished())
        except RuntimeError:  # a backend without futures: the end as waited
            pass
    except BaseException:
        stack.close()
        raise
    return PendingA2a(stack, work, out, x)


def piece_forward(
    piece: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``(y, a, b, s, h)`` of ``y = w2(silu(w1 x) * w3 x)``: the output and what backward needs."""
    a, b = F.linear(piece, w1), F.linear(piece, w3)
    s = F.silu(a)
    h = s * b
    return F.linear(h, w2), a, b, s, h


class ExpertsFFN(torch.autograd.Function):
    """Every held expert's FFN over the received rows (see the module).

    ``apply(received, sizes, owners, block, send, recv, *weights)``: ``received`` [rows,
    hidden] split into pieces of ``sizes`` rows, piece ``i`` computed by held expert
    ``owners[i]``; ``weights`` three per held expert (``w1``, ``w3``, ``w2``); ``send`` /
    ``recv`` the dispatch's forward row counts (the reverse a2a swaps them). Returns the
    non-empty pieces' outputs concatenated (zero rows when there are none)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        received: torch.Tensor,
        sizes: Sequence[int],
        owners: Sequence[int],
        block: Any,
        send: list[int],
        recv: list[int],
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        outputs, saved = [], []
        for piece, owner in zip(received.split(list(sizes)), owners, strict=True):
            if piece.shape[0] == 0:
                continue
            y, *kept = piece_forward(piece, *weights[3 * owner : 3 * owner + 3])
            outputs.append(y)
            saved += kept
        ctx.sizes, ctx.owners, ctx.block = list(sizes), list(owners), block
        ctx.send, ctx.recv = send, recv
        ctx.save_for_backward(received, *weights, *saved)
        if outputs:
            return torch.cat(outputs)
        return received.new_empty((0, received.shape[1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        received, *rest = ctx.saved_tensors
        count = 3 * len(ctx.block.held)
        weights, saved = rest[:count], rest[count:]
        pieces = [
            (piece, owner)
            for piece, owner in zip(received.split(ctx.sizes), ctx.owners, strict=True)
            if piece.shape[0]
        ]
        grads = grad.split([piece.shape[0] for piece, _ in pieces]) if pieces else []
        kept = [tuple(saved[4 * i : 4 * i + 4]) for i in range(len(pieces))]
        inner = [
            piece_input_grad(dy, weights[3 * owner : 3 * owner + 3], *k)
            for dy, (_, owner), k in zip(grads, pieces, kept, strict=True)
        ]
        dx = torch.cat([g for g, *_ in inner]) if inner else torch.zeros_like(received)
        ctx.block.pending_reverse = launch(dx, ctx.recv, ctx.send, ctx.block)
        weight_grads: list[torch.Tensor | None] = [None] * count
        for (piece, owner), dy, k, (_, da, db) in zip(pieces, grads, kept, inner, strict=True):
            for slot, g in zip(range(3 * owner, 3 * owner + 3), (da, db, dy), strict=True):
                if ctx.needs_input_grad[6 + slot]:
                    src = k[3] if slot == 3 * owner + 2 else piece  # w2's input is h
                    part = g.t().mm(src)
                    current = weight_grads[slot]
                    weight_grads[slot] = part if current is None else current + part
        return (dx, None, None, None, None, None, *weight_grads)


def piece_input_grad(
    dy: torch.Tensor,
    weights: Sequence[torch.Tensor],
    a: torch.Tensor,
    b: torch.Tensor,
    s: torch.Tensor,
    h: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, da, db)`` of one piece: the input gradient and the two gate branches' output
    gradients (what ``w1``'s and ``w3``'s weight gradients need)."""
    w1, w3, w2 = weights
    dh = dy.mm(w2)
    db = dh * s
    da = torch.ops.aten.silu_backward(dh * b, a)
    return da.mm(w1) + db.mm(w3), da, db


def run_experts(
    block: Any, received: torch.Tensor, sizes: list[int], send: list[int], recv: list[int]
) -> torch.Tensor:
    """The held experts' outputs for ``received`` (pieces of ``sizes`` rows, piece ``i`` for
    held expert ``i % len(block.held)``) through :class:`ExpertsFFN`."""
    local = len(block.held)
    owners = [i % local for i in range(len(sizes))]
    weights = [
        layer.weight
        for e in block.held
        for layer in (block.experts[e].w1, block.experts[e].w3, block.experts[e].w2)
    ]
    return ExpertsFFN.apply(received, sizes, owners, block, send, recv, *weights)
