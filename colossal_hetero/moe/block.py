"""Expert-parallel Mixtral block whose all-to-alls go through the gradient reducers' gate.

``HeteroEPMixtralSparseMoeBlock`` subclasses Colossal-AI's ``EPMixtralSparseMoeBlock`` (so
Colossal-AI's checkpoint and optimizer code recognise it, and its expert parameters carry the
ep group) and replaces its dispatch:

- Experts live where a :class:`.placement.Placement` puts them (Colossal-AI: contiguous
  blocks only). Each (token, choice) is sent to the device of its expert, sorted there by the
  device's own expert order, computed, sent back and weighted as Hugging Face's
  ``MixtralSparseMoeBlock`` does: the same function, so an EP run equals the dense model.
- Every a2a is a call on ``ep_group`` inside :meth:`.comm.MoeComm.a2a_call`, and the expert
  computation between dispatch and combine is a *pending span* (forward, and in backward from
  the combine's a2a to the dispatch's), during which no gradient chunk launches (priority on).
- Every rank issues the same a2a sequence whatever the routing: a rank that receives no
  tokens still takes part in both a2a's, forward and backward (the combine's input then is
  the empty received tensor itself, so autograd keeps the backward a2a). Colossal-AI's
  per-step all-reduce of active experts over ``moe_dp_group`` is not issued: our reducers
  average expert gradients over all data-parallel ranks instead of rescaling them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from colossalai.lazy import LazyInitContext
from colossalai.shardformer.layer import Linear1D_Col, Linear1D_Row
from colossalai.shardformer.modeling.mixtral import EPMixtralSparseMoeBlock
from colossalai.shardformer.shard.utils import set_tensors_to_none
from colossalai.tensor.moe_tensor.api import set_moe_tensor_ep_group
from torch.distributed import ProcessGroup

from colossal_hetero.moe.a2a_autograd import Combine, Dispatch, FoldedDispatch, all_to_all_rows
from colossal_hetero.moe.comm import MoeComm, Span
from colossal_hetero.moe.exchange import Route, held_exchange
from colossal_hetero.moe.expert_ffn import PendingA2a, fusable, run_experts
from colossal_hetero.moe.folded import PairHistory, header_fits
from colossal_hetero.moe.packed import packed_exchange
from colossal_hetero.moe.pipelined import pipelined_exchange
from colossal_hetero.moe.placement import Placement


class HeteroEPMixtralSparseMoeBlock(EPMixtralSparseMoeBlock):
    """Colossal-AI's EP Mixtral block with placed experts and gated a2a's (see the module)."""

    comm: MoeComm
    placement: Placement
    held: tuple[int, ...]
    backward_spans: list[Span]
    packing: bool = False  # moe.packing: one row per (token, rank), combined there (packed.py)
    pipeline_chunks: int = 1  # token ranges of a2a/expert pipelining (pipelined.py)
    dispatched_rows: int = 0  # rows the last training forward dispatched (pipeline_choice.py)
    fold_counts: bool = True  # the routing counts inside the dispatch a2a (folded.py)
    fold_history: PairHistory | None = None
    fuse_experts: bool = True  # the experts' node overlapping the dispatch's backward a2a
    overlap_own_rows: bool = True  # with fuse_experts: one node for the exchange (exchange.py)
    pending_reverse: PendingA2a | None = None  # the dispatch's backward a2a, launched early
    dispatch_counts: tuple[list[int], list[int]] = ([], [])  # the last dispatch's (send, recv)

    @staticmethod
    def from_native_module(  # type: ignore[override]
        module: Any,
        tp_group: ProcessGroup | None = None,
        moe_dp_group: ProcessGroup | None = None,
        ep_group: ProcessGroup | None = None,
        *args: Any,
        comm: MoeComm | None = None,
        placement: Placement | None = None,
        packing: bool = False,
        **kwargs: Any,
    ) -> HeteroEPMixtralSparseMoeBlock:
        """Turn a ``MixtralSparseMoeBlock`` into this block in place (shardformer's hook)."""
        if ep_group is None or comm is None or placement is None:
            raise ValueError("HeteroEPMixtralSparseMoeBlock needs ep_group, comm and placement")
        LazyInitContext.materialize(module)
        module.__class__ = HeteroEPMixtralSparseMoeBlock
        module.setup_placement(ep_group, moe_dp_group, comm, placement, tp_group)
        module.packing = packing
        return module

    def setup_placement(
        self,
        ep_group: ProcessGroup,
        moe_dp_group: ProcessGroup | None,
        comm: MoeComm,
        placement: Placement,
        tp_group: ProcessGroup | None = None,
    ) -> None:
        """Keep the experts ``placement`` gives this ep rank; drop the others' tensors. With a
        ``tp_group`` of more than one rank each held expert is split over it as Colossal-AI
        splits it (w1, w3 by output columns, w2 by input rows, its output all-reduced): the
        tp peers hold the same tokens and routing, so each issues the same a2a's on its own
        ep group and computes its slice of every expert's FFN."""
        self.ep_group, self.ep_size = ep_group, dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        self.moe_dp_group = moe_dp_group
        if placement.num_experts != self.num_experts or placement.num_devices != self.ep_size:
            raise ValueError(
                f"moe.placement: places {placement.num_experts} experts on "
                f"{placement.num_devices} ranks, the model has {self.num_experts} on ep "
                f"{self.ep_size}"
            )
        self.comm, self.backward_spans = comm, []
        self.index_placement(placement)
        kept = {self.experts[e] for e in self.held}
        set_tensors_to_none(self.experts, exclude=kept)
        self.tp_group = tp_group
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            for expert in kept:
                expert.w1 = Linear1D_Col.from_native_module(expert.w1, tp_group)
                expert.w3 = Linear1D_Col.from_native_module(expert.w3, tp_group)
                expert.w2 = Linear1D_Row.from_native_module(expert.w2, tp_group)
        for expert in kept:
            for param in expert.parameters():
                set_moe_tensor_ep_group(param, ep_group)

    def index_placement(self, placement: Placement) -> None:
        """Adopt ``placement``'s routing tables (held experts, slots); tensors are not moved
        here (setup drops the others', moe/replace.py moves them)."""
        self.placement = placement
        self.held = placement.experts_on(self.ep_rank)
        # Slot order: experts grouped by device, each device's in increasing index.
        order = [e for d in range(self.ep_size) for e in placement.experts_on(d)]
        slot_of = [0] * self.num_experts
        for slot, expert in enumerate(order):
            slot_of[expert] = slot
        self.slot_of = torch.tensor(slot_of, dtype=torch.long)
        self.device_sizes = [len(placement.experts_on(d)) for d in range(self.ep_size)]
        self.fold_history = None  # counts per pair start again under a new placement

    def _fold_history(self) -> PairHistory | None:
        """This block's per-pair row counts (moe/folded.py); None with ``fold_counts`` off."""
        if not self.fold_counts:
            return None
        if getattr(self, "fold_history", None) is None:
            self.fold_history = PairHistory(self.ep_size)
        return self.fold_history

    def _may_fold(self, dispatch: torch.Tensor) -> bool:
        """Whether this forward may fold the counts (the same answer on every ep rank): the
        header fits a row, and no pipelining choice is still measuring the counts a2a."""
        chooser = self.comm.chooser
        if chooser is not None and chooser.measuring:
            return False
        return header_fits(dispatch.shape[1] * dispatch.element_size(), self.device_sizes)

    def mark_idle(self, reached: list[int], learning: bool | None = None) -> None:
        """Tell the reducers which held experts no token reached in this training forward
        (``reached[j]``: rows for held slot ``j``): they get no gradient in the coming
        backward, so their chunks may go before the flush (``MoeComm.idle``). Local; nothing
        in eval or under no_grad (``learning``: whether the forward is a training one with
        gradients, for callers inside an autograd Function's forward, where grad is off)."""
        if learning is None:
            learning = self.training and torch.is_grad_enabled()
        if not learning:
            return
        idle = [
            p
            for j, n in enumerate(reached)
            if n == 0
            for p in self.experts[self.held[j]].parameters()
        ]
        if idle:
            self.comm.idle(idle)

    def expert_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters of the experts this rank holds (reduced over their replicas)."""
        return [p for e in self.held for p in self.experts[e].parameters()]

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, hidden = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(hidden_states)
            hidden_states = hidden_states * noise.uniform_(
                1 - self.jitter_noise, 1 + self.jitter_noise
            )
        x = hidden_states.view(-1, hidden)
        router_logits = self.gate(x)
        weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, selected = torch.topk(weights, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        if self.training:
            self.dispatched_rows = selected.numel()
        span = self.comm.open_span(self.ep_group)
        try:
            if self.packing:
                out = packed_exchange(self, x, selected, weights)
            else:
                if self.pipeline_chunks > 1:
                    combined = pipelined_exchange(self, x, selected, self.pipeline_chunks)
                else:
                    combined = self._exchange(x, selected)
                out = (combined.view(-1, self.top_k, hidden) * weights.unsqueeze(-1)).sum(dim=1)
        finally:
            self.comm.close_span(span)
        return out.view(batch, seq, hidden), router_logits

    def _exchange(self, x: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """Rows ``t * k + j``: expert ``selected[t, j]``'s output for token ``t``."""
        slots = self.slot_of.to(selected.device)[selected.reshape(-1)]
        order = torch.argsort(slots, stable=True)
        dispatch = x[order // self.top_k]
        counts = torch.bincount(slots, minlength=self.num_experts)
        local = len(self.held)
        send = [int(c.sum()) for c in counts.split(self.device_sizes)]
        # Each rank learns, from every peer, how many rows each of its experts gets: in the
        # dispatch itself once the block has a history (moe/folded.py), else by an a2a first.
        history = self._fold_history()
        folded = history is not None and history.ready and self._may_fold(dispatch)
        if self.fuse_experts and self.overlap_own_rows and fusable(self):
            peer = None if folded else _all_to_all_counts(counts, self.device_sizes, local, self)
            learning = self.training and torch.is_grad_enabled()
            back = held_exchange(self, dispatch, Route(counts, send, peer, history, learning))
        else:
            back = self._exchange_nodes(dispatch, counts, send, folded, history)
        restore = torch.empty_like(order)
        restore[order] = torch.arange(order.numel(), device=order.device)
        return back[restore]

    def _exchange_nodes(
        self,
        dispatch: torch.Tensor,
        counts: torch.Tensor,
        send: list[int],
        folded: bool,
        history: PairHistory | None,
    ) -> torch.Tensor:
        """The exchange as separate nodes (dispatch, experts, combine): the rows back in
        ``dispatch``'s order. Tensor-parallel experts take it, and ``overlap_own_rows`` off."""
        local = len(self.held)
        if folded:
            received, peer_counts = FoldedDispatch.apply(dispatch, counts, self)
        else:
            peer_counts = _all_to_all_counts(counts, self.device_sizes, local, self)
        self.mark_idle(peer_counts.view(self.ep_size, local).sum(dim=0).tolist())
        recv = peer_counts.view(self.ep_size, local).sum(dim=1).tolist()
        if not folded:
            received = Dispatch.apply(dispatch, send, recv, self)
        if history is not None:
            history.record(send, recv)
        if self.fuse_experts and fusable(self):  # weight grads overlap the reverse dispatch
            sizes = peer_counts.tolist()
            expert_out = run_experts(self, received, sizes, *self.dispatch_counts)
        else:
            expert_out = self._plain_experts(received, peer_counts.tolist())
        return Combine.apply(expert_out, recv, send, self)

    def _plain_experts(self, received: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The held experts' outputs piece by piece through their own modules (tensor-parallel
        experts; :func:`.expert_ffn.fusable` says when the fused node applies instead)."""
        local = len(self.held)
        outputs = []
        for index, piece in enumerate(received.split(sizes)):
            if piece.shape[0] == 0:
                continue
            expert = self.experts[self.held[index % local]]
            outputs.append(expert.w2(expert.act_fn(expert.w1(piece)) * expert.w3(piece)))
        # No rows here: the empty received tensor stands in, so both backward a2a's still run.
        return torch.cat(outputs) if outputs else received


def _all_to_all_counts(
    counts: torch.Tensor, device_sizes: list[int], local: int, block: Any
) -> torch.Tensor:
    """Row counts per (source rank, held expert): ``local`` values from each of ep peers."""
    recv = [local] * block.ep_size
    with torch.no_grad():
        return all_to_all_rows(counts, device_sizes, recv, block.ep_group, block.comm)
