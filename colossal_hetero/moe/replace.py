"""Speed-aware expert re-placement at runtime: moving experts between expert-parallel ranks.

The runtime half of :mod:`.placement` (the decision, pure, lives in :mod:`.replace_policy`):

- :class:`ExpertLoadMeter` counts, per MoE layer, the (token, choice) pairs the router sends
  to each expert (forward hooks on the gates; training forwards only): the measured loads.
- :func:`move_experts` moves the experts whose rank changes, weights *and* optimizer state,
  bit for bit (tensors sent as they are, point to point inside the ep group), re-indexes
  the block's routing tables and returns the parameters this rank now holds.
- :class:`ExpertReplacer` is the seam controller (plugin/seam.py): every ``moe.replace_every``
  steps, after the optimizer step, it sums the loads over the world (one small all-reduce, the
  only agreement needed: the decision is a pure function of identical inputs), decides, acts
  if any layer's placement changes, re-binds the expert gradient reducer to the held
  parameters, and writes a DecisionWriter record (``moe_placement``). With ``moe.packing``
  on it decides with the packing-aware objective from the routing histogram and costs that
  :class:`.replace_packing.PackingMeter` measures (one more all-reduce and all-gather).

Contract of a move: afterwards every rank's expert ``e`` of layer ``l`` (on the rank the new
placement names) has the same parameter values and optimizer state as the old holder had, so
training continues exactly as it would have (the same arithmetic on the same values; only
where it runs changes). ``parallel.zero_stage`` 0 with either of Colossal-AI's wrappers:

- fp32 (``HybridParallelNaiveOptimizer``): the torch optimizer steps the parameters, its
  state is keyed by them;
- bf16 / fp16 (``HybridParallelAMPOptimizer``): the torch optimizer steps an fp32 master per
  working parameter (its groups and state hold the masters; the wrapper maps working <->
  master both ways; fp16's loss scaler also lists the working parameters it checks for
  overflow). A move sends the working weight, the master and the master's state; the old
  holder drops all three from the groups, the state, the maps and the overflow list, the new
  one enters the received tensors there (the loss scale is one value for the whole world).

- ZeRO (``zero_stage`` 1, and 2 which Colossal-AI's MoE plugin runs as 1): the working
  weight is whole, the fp32 master and its state are this rank's flat slice over the
  expert's ``moe_dp`` group; old and new holder have the same ``moe_dp`` rank and group size,
  so the slices travel as they are (moe/replace_zero.py keeps the ZeRO optimizer's
  bookkeeping).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from colossalai.tensor.moe_tensor.api import set_moe_tensor_ep_group
from torch import nn

from colossal_hetero.metrics.decisions import DecisionWriter
from colossal_hetero.moe.placement import Placement
from colossal_hetero.moe.replace_packing import PackingMeter, routed_choices
from colossal_hetero.moe.replace_policy import (
    MIN_GAIN,
    decide_placements,
    ep_capacity,
    ep_speeds,
)
from colossal_hetero.moe.replace_zero import ZeroExperts, is_zero
from colossal_hetero.utils.collectives import all_reduce_anywhere
from colossal_hetero.utils.device import is_host_device

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
            chosen = routed_choices(block, logits)
            if chosen is not None:
                loads = torch.bincount(chosen.reshape(-1), minlength=block.num_experts)
                self.counts[layer] += loads

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


class _Optimizer:
    """An optimizer as a move sees it: the torch optimizer inside (param groups and state keyed
    by the tensors it steps) and, under mixed precision (Colossal-AI's AMP wrapper at
    ``zero_stage`` 0), the maps between each bf16/fp16 working parameter and the fp32 master
    the torch optimizer steps instead, plus fp16's list of working parameters it checks for
    overflow. Without the wrapper's maps a parameter is its own master (fp32)."""

    def __init__(self, optimizer: Any) -> None:
        self.inner = _inner_optimizer(optimizer)
        self.to_master: dict[Any, torch.Tensor] | None = getattr(
            optimizer, "working_to_master_map", None
        )
        self.to_working: dict[Any, Any] | None = getattr(optimizer, "master_to_working_map", None)
        self.mixed: Any = getattr(optimizer, "mixed_precision", None)

    def check_between_steps(self) -> None:
        """Nothing to refuse without ZeRO (the reducers are re-bound by the caller)."""

    def layout(self, numel: int) -> None:
        """Parameters are whole: no shard layout to agree on."""

    def finish(self) -> None:
        """Nothing to reorder: the wrapper steps its groups in any order."""

    def master(self, param: nn.Parameter) -> torch.Tensor:
        return param if self.to_master is None else self.to_master.get(param, param)

    def state(self, param: nn.Parameter) -> dict[str, Any]:
        return self.inner.state.get(self.master(param), {})

    def release(self, param: nn.Parameter) -> None:
        """Forget ``param``: its master leaves the groups, the state and the maps."""
        master = self.master(param)
        for group in self.inner.param_groups:
            group["params"] = [p for p in group["params"] if p is not master]
        self.inner.state.pop(master, None)
        if master is not param and self.to_master is not None and self.to_working is not None:
            del self.to_master[param], self.to_working[master]
        if isinstance(getattr(self.mixed, "params", None), list):
            self.mixed.params = [p for p in self.mixed.params if p is not param]

    def adopt(
        self, param: nn.Parameter, master: torch.Tensor, group: int | None, state: dict[str, Any]
    ) -> None:
        """Step ``param`` through ``master`` (``param`` itself without mixed precision)."""
        if master is not param and self.to_master is not None and self.to_working is not None:
            self.to_master[param], self.to_working[master] = master, param
        if group is not None:
            self.inner.param_groups[group]["params"].append(master)
        if state:
            self.inner.state[master] = state
        if isinstance(getattr(self.mixed, "params", None), list):
            self.mixed.params.append(param)


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).split(".")[-1]


def _describe(block: Any, expert: int, optim: _View) -> list[Meta]:
    """What the holder sends for one expert: per parameter its name, shape and dtype, its fp32
    master's (None when the parameter is its own master), optimizer group and state (tensors
    by shape and dtype, other values as they are)."""
    described = []
    group_of = {
        id(p): g for g, group in enumerate(optim.inner.param_groups) for p in group["params"]
    }
    for name, param in block.experts[expert].named_parameters():
        master = optim.master(param)
        state: dict[str, tuple[Any, ...]] = {}
        for key, value in optim.state(param).items():
            if isinstance(value, torch.Tensor):
                state[key] = ("tensor", tuple(value.shape), _dtype_name(value))
            else:
                state[key] = ("value", value)
        described.append(
            {
                "name": name,
                "shape": tuple(param.shape),
                "dtype": _dtype_name(param),
                "master": None if master is param else (tuple(master.shape), _dtype_name(master)),
                "group": group_of.get(id(master)),
                "state": state,
                "layout": optim.layout(param.numel()),
                "on_host": [is_host_device(t.device) for t in _param_tensors(param, optim)],
            }
        )
    return described


def _param_tensors(param: nn.Parameter, optim: _View) -> list[torch.Tensor]:
    """One parameter's tensors as a move sends them: weight, master (if its own), state."""
    out = [param.data]
    master = optim.master(param)
    if master is not param:
        out.append(master.data)
    out += [v for v in optim.state(param).values() if isinstance(v, torch.Tensor)]
    return out


def _tensors(block: Any, expert: int, optim: _View) -> list[torch.Tensor]:
    """The holder's tensors of one expert, in the order :func:`_describe` lists them, each on
    the weight's device: the wire's (an optimizer keeps some state elsewhere, e.g. Adam's
    ``step`` on the host, which NCCL cannot send)."""
    out = []
    for _, param in block.experts[expert].named_parameters():
        out += [t.to(param.device) for t in _param_tensors(param, optim)]
    return out


def _wire_device(block: Any) -> torch.device:
    """This rank's device for a move's transfers: the one its dense router weight lives on."""
    return block.gate.weight.device


def _set_param(module: nn.Module, name: str, value: nn.Parameter | None) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, attr, value)


def move_experts(
    blocks: Sequence[Any], new: Sequence[Placement], optimizer: Any
) -> list[nn.Parameter]:
    """Move every expert whose ep rank changes from ``block.placement`` to ``new[layer]``
    (weights, fp32 masters under mixed precision, and optimizer state, exactly); returns the
    expert parameters held afterwards.

    Collective over each block's ep group (every ep rank calls it with the same ``new``);
    between steps only (no gradients pending).
    """
    optim = _view(optimizer)
    optim.check_between_steps()
    group = blocks[0].ep_group
    me = dist.get_rank(group)
    moves = [
        (layer, e, old_d, new[layer].device_of[e])
        for layer, block in enumerate(blocks)
        for e, old_d in enumerate(block.placement.device_of)
        if old_d != new[layer].device_of[e]
    ]
    mine = {
        (layer, e): _describe(blocks[layer], e, optim) for layer, e, src, _ in moves if src == me
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
            buffers = _receive_buffers(meta[(layer, e)], _wire_device(blocks[layer]))
            peer = dist.get_global_rank(group, src)
            pending += [dist.irecv(b, peer, group=group, tag=tag) for b in buffers]
            arriving.append((layer, e, buffers))
    for work in pending:
        work.wait()
    for layer, e, src, _ in moves:
        if src == me:
            _release(blocks[layer], e, optim)
    for layer, e, buffers in arriving:
        _adopt(blocks[layer], e, meta[(layer, e)], _settle(meta[(layer, e)], buffers), optim)
    optim.finish()
    for layer, block in enumerate(blocks):
        block.index_placement(new[layer])
    return [p for block in blocks for p in block.expert_parameters()]


_View = _Optimizer | ZeroExperts


def _view(optimizer: Any) -> _View:
    """How a move reaches ``optimizer``'s tensors: ZeRO's slices or whole parameters."""
    return ZeroExperts(optimizer) if is_zero(optimizer) else _Optimizer(optimizer)


def _receive_buffers(described: list[Meta], wire: torch.device) -> list[torch.Tensor]:
    """Empty tensors for one expert's arriving tensors, on ``wire`` (the sender sends them
    from its weight's device); :func:`_settle` moves host-kept ones back after the wait."""
    buffers = []
    for param in described:
        shapes = [(param["shape"], param["dtype"])]
        shapes += [] if param["master"] is None else [param["master"]]
        shapes += [tuple(rest) for kind, *rest in param["state"].values() if kind == "tensor"]
        buffers += [torch.empty(shape, dtype=getattr(torch, d), device=wire) for shape, d in shapes]
    return buffers


def _settle(described: list[Meta], buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Arrived tensors on the device kind the old holder kept each on (host or the wire's)."""
    on_host = [flag for param in described for flag in param["on_host"]]
    return [b.cpu() if host else b for b, host in zip(buffers, on_host, strict=True)]


def _release(block: Any, expert: int, optim: _View) -> None:
    for name, param in list(block.experts[expert].named_parameters()):
        optim.release(param)
        _set_param(block.experts[expert], name, None)


def _adopt(
    block: Any,
    expert: int,
    described: list[Meta],
    buffers: list[torch.Tensor],
    optim: _View,
) -> None:
    values = iter(buffers)
    for param_meta in described:
        here = optim.layout(math.prod(param_meta["shape"]))
        if param_meta["layout"] != here:
            raise RuntimeError(
                f"expert re-placement: {param_meta['name']} of expert {expert} is sliced as "
                f"{param_meta['layout']} on the old holder, {here} here: the ranks "
                "of one ep group must share their moe_dp rank and group size"
            )
        param = nn.Parameter(next(values))
        master = param if param_meta["master"] is None else next(values)
        state: dict[str, Any] = {}
        for key, (kind, *rest) in param_meta["state"].items():
            state[key] = next(values) if kind == "tensor" else rest[0]
        _set_param(block.experts[expert], param_meta["name"], param)
        set_moe_tensor_ep_group(param, block.ep_group)
        optim.adopt(param, master, param_meta["group"], state)


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
        packing: bool = False,
    ) -> None:
        self.blocks, self.optimizer, self.reducer = list(blocks), optimizer, reducer
        ep = blocks[0].ep_size
        self.speeds = ep_speeds(speeds, ep)
        self.capacity = ep_capacity(capacity, blocks[0].num_experts, ep)
        self.every = every
        self.min_gain = MIN_GAIN
        self.meter = ExpertLoadMeter(blocks)
        self.packing = PackingMeter(blocks, speeds) if packing else None
        self.writer = DecisionWriter(folder, "moe_placement", rank)

    def on_step_end(self, step: int, timing: Any) -> None:
        if self.packing is not None:
            self.packing.observe_step()
        if self.every < 1 or (step + 1) % self.every:
            return
        loads = self.meter.take().to(torch.float64)
        all_reduce_anywhere(loads)  # the one agreement: identical loads, so identical decisions
        current = [block.placement for block in self.blocks]
        args = (self.speeds, self.capacity, current, self.min_gain)
        if self.packing is not None:  # identical histogram and agreed costs: same decision
            new, record = self.packing.decide(loads, *args)
        else:
            new, record = decide_placements(loads.tolist(), *args)
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
        all_reduce_anywhere(loads)
        state = {"placements": [list(b.placement.device_of) for b in self.blocks], "loads": loads}
        if self.packing is not None:  # the routing histogram too (moe.packing)
            state["routing"] = self.packing.state()
        return state

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
        if self.packing is not None and "routing" in state:
            self.packing.restore(state["routing"])

    def close(self) -> None:
        self.meter.remove()
        if self.packing is not None:
            self.packing.remove()
        self.writer.close()


def build_replacer(
    config: Any, model: nn.Module, optimizer: Any, reducers: dict[str, Any], folder: Any, rank: int
) -> ExpertReplacer:
    """The plugin's replacer for ``moe.replace_every > 0`` (any zero_stage; tp 1: checked)."""
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
        packing=moe.packing,
    )


def _clone(value: Any) -> Any:
    return value.detach().clone() if torch.is_tensor(value) else value


def _whole(optimizer: Any) -> _Optimizer | None:
    """The optimizer of :func:`expert_state` and :func:`load_expert_state`: whole parameters
    only (ZeRO's master slices need gathering over each expert's group, which the plugin's
    checkpoint IO does, checkpoint/moe.py)."""
    if optimizer is None:
        return None
    if is_zero(optimizer):
        raise ValueError(
            "parallel.zero_stage: expert_state / load_expert_state take whole parameters "
            "(zero_stage 0); under ZeRO save and load through the plugin's checkpoint IO"
        )
    return _Optimizer(optimizer)


def expert_state(blocks: Sequence[Any], optimizer: Any = None) -> dict[str, Any]:
    """Every expert of every layer, keyed by placement-free names ``"{layer}.{expert}.{param}"``
    (``param`` e.g. ``w1.weight``), each ``{"value": tensor, "optim": {key: value}}`` plus,
    under mixed precision, ``"master"``: the fp32 master the optimizer steps (its state is the
    master's); gathered from the ranks that hold them (collective over the ep group): an
    expert-parallel checkpoint that loads under any placement (:func:`load_expert_state`)."""
    optim = _whole(optimizer)
    mine: dict[str, Any] = {}
    for layer, block in enumerate(blocks):
        for e in block.held:
            for name, param in block.experts[e].named_parameters():
                entry: dict[str, Any] = {"value": param.detach().clone(), "optim": {}}
                if optim is not None:
                    entry["optim"] = {k: _clone(v) for k, v in optim.state(param).items()}
                    if optim.master(param) is not param:
                        entry["master"] = optim.master(param).detach().clone()
                mine[f"{layer}.{e}.{name}"] = entry
    group = blocks[0].ep_group
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return {key: value for part in everyone for key, value in part.items()}


def load_expert_state(blocks: Sequence[Any], state: dict[str, Any], optimizer: Any = None) -> None:
    """Load the experts this rank holds under its current placement from :func:`expert_state`
    (saved under any placement); under mixed precision the master is the saved one (or the
    saved value in fp32). KeyError naming the first missing expert tensor."""
    optim = _whole(optimizer)
    for layer, block in enumerate(blocks):
        for e in block.held:
            for name, param in block.experts[e].named_parameters():
                key = f"{layer}.{e}.{name}"
                if key not in state:
                    raise KeyError(f"expert checkpoint: no tensor for {key}")
                saved = state[key]
                with torch.no_grad():
                    param.copy_(saved["value"])
                    master = param if optim is None else optim.master(param)
                    if master is not param:
                        master.copy_(saved.get("master", saved["value"]))
                if optim is not None and saved["optim"]:
                    optim.inner.state[master] = {k: _clone(v) for k, v in saved["optim"].items()}
