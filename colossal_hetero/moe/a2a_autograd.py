"""The expert-parallel block's all-to-alls as autograd functions (used by ``moe/block.py`` and
``moe/packed.py``, apart so that neither imports the other).

Every a2a is ``all_to_all_single`` on the block's ``ep_group`` inside
:meth:`.comm.MoeComm.a2a_call`. ``block`` is a :class:`.block.HeteroEPMixtralSparseMoeBlock`
(typed ``Any`` here: the functions read its ``ep_group``, ``comm``, spans and counters).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal_hetero.moe.comm import MoeComm
from colossal_hetero.moe.folded import folded_dispatch


def all_to_all_rows(
    x: torch.Tensor, send: list[int], recv: list[int], group: ProcessGroup, comm: MoeComm
) -> torch.Tensor:
    """Rows ``send[d]`` of ``x`` to rank ``d`` of ``group``; returns ``recv[d]`` rows from each."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    with comm.a2a_call(group, x.numel() * x.element_size()) as event:
        work = dist.all_to_all_single(out, x, recv, send, group=group, async_op=True)
        event.issued()
        assert work is not None
        work.wait()
    return out


class Dispatch(torch.autograd.Function):
    """Forward: the dispatch a2a (inside the span the caller opened). Backward: the reverse
    a2a, which closes the backward span opened by :class:`Combine`'s backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], block: Any) -> Any:
        ctx.send, ctx.recv, ctx.block = send, recv, block
        block.dispatch_counts = (send, recv)
        return all_to_all_rows(x, send, recv, block.ep_group, block.comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        block = ctx.block
        pending, block.pending_reverse = block.pending_reverse, None
        try:  # the experts' node may have launched this a2a already (moe/expert_ffn.py)
            if pending is not None:
                out = pending.wait()
            else:
                out = all_to_all_rows(grad, ctx.recv, ctx.send, block.ep_group, block.comm)
        finally:
            span = block.backward_spans.pop() if block.backward_spans else None
            if span is not None:
                block.comm.close_span(span)
        return out, None, None, None


class FoldedDispatch(torch.autograd.Function):
    """Forward: the dispatch a2a with the routing counts folded in (moe/folded.py); returns
    the received rows and the counts per (peer, held expert). Backward: as :class:`Dispatch`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: torch.Tensor, block: Any) -> Any:
        received, peer_counts, send, recv = folded_dispatch(block, x, counts, block.fold_history)
        ctx.send, ctx.recv, ctx.block = send, recv, block
        block.dispatch_counts = (send, recv)
        ctx.mark_non_differentiable(peer_counts)
        return received, peer_counts

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> Any:
        return Dispatch.backward(ctx, grad)[0], None, None


class Combine(torch.autograd.Function):
    """Forward: the combine a2a. Backward: opens the backward span, then the reverse a2a."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, send: list[int], recv: list[int], block: Any) -> Any:
        ctx.send, ctx.recv, ctx.block = send, recv, block
        return all_to_all_rows(y, send, recv, block.ep_group, block.comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        block = ctx.block
        block.backward_spans.append(block.comm.open_span(block.ep_group))
        out = all_to_all_rows(grad, ctx.recv, ctx.send, block.ep_group, block.comm)
        return out, None, None, None
