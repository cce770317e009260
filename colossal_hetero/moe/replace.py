"""Speed-aware expert re-placement at runtime: moving experts between expert-parallel ranks.

The runtime half of :mod:`.placement` (the decision, pure, lives in :mod:`.replace_policy`):

- :class:`ExpertLoadMeter` counts, per MoE layer, the (token, choice) pairs the router sends
  to each expert (forward hooks on the gates; training forwards only): the measured loads.
- :func:`move_experts` moves the experts whose rank changes, weights *and* optimizer state,
  bit for bit (fp32 tensors sent as they are, point to point inside the ep group), re-indexes
  the block's routing tables and returns the parameters this rank now holds.
- :class:`ExpertReplacer` is the seam controller (plugin/seam.py): every ``moe.replace_every``
  steps, after the optimizer step, it sums the loads over the world (one small all-reduce, the
  only agreement needed: the decision is a pure function of identical inputs), decides, acts
  if any layer's placement changes, re-binds the expert gradient reducer to the held
  parameters, and writes a DecisionWriter record (``moe_placement``).

Contract of a move: afterwards every rank's expert ``e`` of layer ``l`` (on the rank the new
placement names) has the same parameter values and optimizer state as the old holder had, so
training continues exactly as it would have (the same arithmetic on the same values; only
where it runs changes). Works with the plain (fp32) optimizer of ``parallel.zero_stage`` 0;
ZeRO and mixed precision keep master copies this module does not move (refused in checks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from colossalai.tensor.moe_tensor.api import set_moe_tensor_ep_group
from torch import nn

from colossal_hetero.metrics.decisions import DecisionWriter
from colossal_hetero.moe.placement import Placement
from colossal_hetero.moe.replace_policy import decide_placements, ep_capacity, ep_speeds

Meta = dict[str, Any]


class ExpertLoadMeter:
    """Per-layer expert loads (router token counts) since the last :meth:`take`."""

    def __init__(self, blocks: Sequence[Any]) -> None:
        self.blocks = list(blocks)
        self.counts = torch.zeros(len(self.blocks), self.blocks[0].num_experts, dtype=torch.long)
        self._hooks = [
            block.gate.register_forward_hook(self._hook(i)) for i, block in enumerate(self.blocks)
        ]

    def _hook(self, layer: int) -> Any:
        def count(module: nn.Module, inputs: Any, logits: torch.Tensor) -> None:
            block = self.blocks[layer]
            if not (block.training and torch.is_grad_enabled()):
                return  # validation does not steer placement
            with torch.no_grad():
                chosen = logits.topk(block.top_k, dim=-1).indices.reshape(-1).cpu()
                self.counts[layer] += torch.bincount(chosen, minlength=block.num_experts)

        return count

    def take(self) -> torch.Tensor:
        """This rank's counts ``[layers, experts]`` since the last take; resets them."""
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        return counts

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Colossal-AI's wrapper (or the optimizer itself)."""
    return getattr(optimizer, "optim", optimizer)


def _describe(block: Any, layer: int, expert: int, optim: torch.optim.Optimizer) -> list[Meta]:
    """What the holder sends for one expert: per parameter its name, optimizer group and state
    (tensors by shape and dtype, other values as they are)."""
    described = []
    group_of = {id(p): g for g, group in enumerate(optim.param_groups) for p in group["params"]}
    for name, param in block.experts[expert].named_parameters():
        state: dict[str, tuple[Any, ...]] = {}
        for key, value in optim.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                state[key] = ("tensor", tuple(value.shape), str(value.dtype).split(".")[-1])
            else:
                state[key] = ("value", value)
        described.append(
            {
                "name": name,
                "shape": tuple(param.shape),
                "dtype": str(param.dtype).split(".")[-1],
                "group": group_of.get(id(param), 0),
                "state": state,
            }
        )
    return described


def _tensors(block: Any, expert: int, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The holder's tensors of one expert, in the order :func:`_describe` lists them."""
    out = []
    for _, param in block.experts[expert].named_parameters():
        out.append(param.data)
        state = optim.state.get(param, {})
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _set_param(module: nn.Module, name: str, value: nn.Parameter | None) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, attr, value)


def move_experts(
    blocks: Sequence[Any], new: Sequence[Placement], optimizer: Any
) -> list[nn.Parameter]:
    """Move every expert whose ep rank changes from ``block.placement`` to ``new[layer]``
    (weights and optimizer state, exactly); returns the expert parameters held afterwards.

    Collective over each block's ep group (every ep rank calls it with the same ``new``);
    between steps only (no gradients pending).
    """
    optim = _inner_optimizer(optimizer)
    group = blocks[0].ep_group
    me = dist.get_rank(group)
    moves = [
        (layer, e, old_d, new[layer].device_of[e])
        for layer, block in enumerate(blocks)
        for e, old_d in enumerate(block.placement.device_of)
        if old_d != new[layer].device_of[e]
    ]
    mine = {
        (layer, e): _describe(blocks[layer], layer, e, optim)
        for layer, e, src, _ in moves
        if src == me
    }
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    meta = {key: value for part in everyone for key, value in part.items()}
    pending: list[Any] = []
    arriving = []
    for tag, (layer, e, src, dst) in enumerate(moves):
        if src == me:
            peer = dist.get_global_rank(group, dst)
            for tensor in _tensors(blocks[layer], e, optim):
                pending.append(dist.isend(tensor.contiguous(), peer, group=group, tag=tag))
        elif dst == me:
            buffers = _receive_buffers(meta[(layer, e)])
            peer = dist.get_global_rank(group, src)
            pending += [dist.irecv(b, peer, group=group, tag=tag) for b in buffers]
            arriving.append((layer, e, buffers))
    for work in pending:
        work.wait()
    for layer, e, src, _ in moves:
        if src == me:
            _release(blocks[layer], e, optim)
    for layer, e, buffers in arriving:
        _adopt(blocks[layer], e, meta[(layer, e)], buffers, optim)
    for layer, block in enumerate(blocks):
        block.index_placement(new[layer])
    return [p for block in blocks for p in block.expert_parameters()]


def _receive_buffers(described: list[Meta]) -> list[torch.Tensor]:
    buffers = []
    for param in described:
        buffers.append(torch.empty(param["shape"], dtype=getattr(torch, param["dtype"])))
        for kind, *rest in param["state"].values():
            if kind == "tensor":
                shape, dtype = rest
                buffers.append(torch.empty(shape, dtype=getattr(torch, dtype)))
    return buffers


def _release(block: Any, expert: int, optim: torch.optim.Optimizer) -> None:
    for name, param in list(block.experts[expert].named_parameters()):
        for group in optim.param_groups:
            group["params"] = [p for p in group["params"] if p is not param]
        optim.state.pop(param, None)
        _set_param(block.experts[expert], name, None)


def _adopt(
    block: Any,
    expert: int,
    described: list[Meta],
    buffers: list[torch.Tensor],
    optim: torch.optim.Optimizer,
) -> None:
    values = iter(buffers)
    for param_meta in described:
        param = nn.Parameter(next(values))
        state: dict[str, Any] = {}
        for key, (kind, *rest) in param_meta["state"].items():
            state[key] = next(values) if kind == "tensor" else rest[0]
        _set_param(block.experts[expert], param_meta["name"], param)
        set_moe_tensor_ep_group(param, block.ep_group)
        optim.param_groups[param_meta["group"]]["params"].append(param)
        if state:
            optim.state[param] = state


class ExpertReplacer:
    """Seam controller: speed-aware re-placement every ``every`` steps (see the module)."""

    def __init__(
        self,
        blocks: Sequence[Any],
        optimizer: Any,
        reducer: Any,
        speeds: Sequence[float],
        every: int,
        capacity: int,
        folder: Any,
        rank: int,
    ) -> None:
        self.blocks, self.optimizer, self.reducer = list(blocks), optimizer, reducer
        ep = blocks[0].ep_size
        self.speeds = ep_speeds(speeds, ep)
        self.capacity = ep_capacity(capacity, blocks[0].num_experts, ep)
        self.every = every
        self.meter = ExpertLoadMeter(blocks)
        self.writer = DecisionWriter(folder, "moe_placement", rank)

    def on_step_end(self, step: int, timing: Any) -> None:
        if self.every < 1 or (step + 1) % self.every:
            return
        loads = self.meter.take().to(torch.float64)
        dist.all_reduce(loads)  # the one agreement: identical loads, so identical decisions
        current = [block.placement for block in self.blocks]
        new, record = decide_placements(loads.tolist(), self.speeds, self.capacity, current)
        record["step"] = step
        if new != current:
            params = move_experts(self.blocks, new, self.optimizer)
            if self.reducer is not None:
                self.reducer.rebind(params)
        self.writer.write(record)

    def state(self) -> dict[str, Any]:
        """What a resumed run needs to decide as this one would: each layer's placement and
        the loads counted since the last decision, summed over the world (one all-reduce;
        integer counts, so the sum is exact in any order)."""
        loads = self.meter.counts.clone()
        dist.all_reduce(loads)
        return {"placements": [list(b.placement.device_of) for b in self.blocks], "loads": loads}

    def restore(self, state: dict[str, Any]) -> None:
        """Adopt :meth:`state` after a checkpoint's weights and optimizer state are loaded:
        experts move to the saved placements exactly (:func:`move_experts`, collective over
        the ep group, on every rank) and the saved loads count towards the next decision."""
        ep = self.blocks[0].ep_size
        saved = [Placement(tuple(int(d) for d in p), ep) for p in state["placements"]]
        if len(saved) != len(self.blocks) or any(
            p.num_experts != b.num_experts for p, b in zip(saved, self.blocks, strict=False)
        ):
            raise ValueError(
                f"checkpoint: saved placements of {len(saved)} layers do not fit the model's "
                f"{len(self.blocks)} MoE layers"
            )
        if saved != [block.placement for block in self.blocks]:
            params = move_experts(self.blocks, saved, self.optimizer)
            if self.reducer is not None:
                self.reducer.rebind(params)
        loads = state["loads"].to(torch.long)
        self.meter.counts = loads if dist.get_rank() == 0 else torch.zeros_like(loads)

    def close(self) -> None:
        self.meter.remove()
        self.writer.close()


def build_replacer(
    config: Any, model: nn.Module, optimizer: Any, reducers: dict[str, Any], folder: Any, rank: int
) -> ExpertReplacer:
    """The plugin's replacer for ``moe.replace_every > 0`` (checked: zero_stage 0, fp32)."""
    from colossal_hetero.moe.block import HeteroEPMixtralSparseMoeBlock

    blocks = [m for m in model.modules() if isinstance(m, HeteroEPMixtralSparseMoeBlock)]
    speeds = config.cluster.speeds(dist.get_world_size())
    moe = config.moe
    return ExpertReplacer(
        blocks,
        optimizer,
        reducers.get("expert"),
        speeds,
        moe.replace_every,
        moe.max_experts_per_rank,
        folder,
        rank,
    )


def expert_state(blocks: Sequence[Any], optimizer: Any = None) -> dict[str, Any]:
    """Every expert of every layer, keyed by placement-free names ``"{layer}.{expert}.{param}"``
    (``param`` e.g. ``w1.weight``), each ``{"value": tensor, "optim": {key: value}}``, gathered
    from the ranks that hold them (collective over the ep group): an expert-parallel checkpoint
    that loads under any placement (:func:`load_expert_state`)."""
    optim = None if optimizer is None else _inner_optimizer(optimizer)
    mine: dict[str, Any] = {}
    for layer, block in enumerate(blocks):
        for e in block.held:
            for name, param in block.experts[e].named_parameters():
                state = {} if optim is None else optim.state.get(param, {})
                mine[f"{layer}.{e}.{name}"] = {
                    "value": param.detach().clone(),
                    "optim": {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()},
                }
    group = blocks[0].ep_group
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return {key: value for part in everyone for key, value in part.items()}


def load_expert_state(blocks: Sequence[Any], state: dict[str, Any], optimizer: Any = None) -> None:
    """Load the experts this rank holds under its current placement from :func:`expert_state`
    (saved under any placement); KeyError naming the first missing expert tensor."""
    optim = None if optimizer is None else _inner_optimizer(optimizer)
    for layer, block in enumerate(blocks):
        for e in block.held:
            for name, param in block.experts[e].named_parameters():
                key = f"{layer}.{e}.{name}"
                if key not in state:
                    raise KeyError(f"expert checkpoint: no tensor for {key}")
                with torch.no_grad():
                    param.copy_(state[key]["value"])
                if optim is not None and state[key]["optim"]:
                    optim.state[param] = {
                        k: v.clone() if torch.is_tensor(v) else v
                        for k, v in state[key]["optim"].items()
                    }
