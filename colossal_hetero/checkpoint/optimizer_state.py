"""Optimizer checkpoints that survive uneven tensor-parallel shards and changes of widths.

Colossal-AI's checkpoint IO gathers optimizer states assuming even TP shards (it asserts
``full == tp_size * local``). Here every state tensor shaped like its parameter is gathered to
the full Hugging Face shape with the parameter's own layout (resizable layers) or Colossal-AI's
even rule (stock layers), and saved once, keyed by the parameter's position in the optimizer.
Loading shards each full state to whatever layout the current parameter has, so a checkpoint
moves between widths, and between uneven and even layouts, without loss.

File: ``<checkpoint>/full_optimizer.pt`` = {"states": {id: {name: tensor}}, "groups": [...]},
where ``id`` is the parameter's position in the optimizer of the whole model, before any
pipeline split (Colossal-AI's ``param_info["param2id"]``). Under pipeline parallelism each stage
writes the states of the parameters it holds to ``full_optimizer_stage<s>.pt``, and loading
merges every file of the folder, so a checkpoint also moves between stage splits.
Scope: tensor parallelism with data and pipeline parallelism, without ZeRO; other layouts use
Colossal-AI's own format.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colossal_hetero.layers.sharding import layout_of
from colossal_hetero.utils.device import host_device

FILE_NAME = "full_optimizer.pt"
_PATTERN = "full_optimizer*.pt"


def stage_file_name(pp_rank: int, pp_size: int) -> str:
    """The file a pipeline stage writes (``FILE_NAME`` without pipeline parallelism)."""
    return FILE_NAME if pp_size == 1 else f"full_optimizer_stage{pp_rank}.pt"


def is_full_format(checkpoint: str | Path) -> bool:
    """Whether ``checkpoint`` (a folder) holds an optimizer saved by ``save_full_optimizer``."""
    return any(Path(checkpoint).glob(_PATTERN))


def _param_ids(optimizer: Any, params: list[tuple[nn.Parameter, nn.Parameter]]) -> list[int]:
    """Each parameter's id in the whole model's optimizer (stable across pipeline splits), or
    its position when the optimizer keeps no ``param_info``."""
    known = getattr(optimizer, "param_info", {}).get("param2id", {})
    if all(id(working) in known for working, _ in params):
        return [known[id(working)] for working, _ in params]
    return list(range(len(params)))


def has_uneven_params(optimizer: Any) -> bool:
    """Whether any parameter of ``optimizer`` is sharded by a resizable layer."""
    return any(layout_of(param) is not None for param, _ in _params(optimizer))


def _params(optimizer: Any) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """(working parameter, the parameter the optimizer steps) in optimizer order."""
    to_working = optimizer.get_master_to_working_map() or {}
    return [
        (to_working.get(id(p), p), p) for group in optimizer.param_groups for p in group["params"]
    ]


def save_full_optimizer(
    optimizer: Any,
    checkpoint: str | Path,
    *,
    gather_even: Callable[[dict, nn.Parameter], dict],
    is_writer: bool,
    file_name: str = FILE_NAME,
) -> None:
    """Gather every state to full shape and write it on the ``is_writer`` rank.

    ``gather_even(state, working_param)`` gathers a stock (even) TP parameter's state.
    Collectives: one all-gather per sharded state tensor over its parameter's TP group; every
    rank must call this with the same optimizer structure.
    """
    states: dict[int, dict[str, Any]] = {}
    params = _params(optimizer)
    for index, (working, param) in zip(_param_ids(optimizer, params), params, strict=True):
        state = optimizer.optim.state.get(param, {})
        gather = _hooks(working)[1]
        if gather is None:
            full = gather_even(dict(state), working) if state else {}
        else:
            full = {k: _gather(v, working, gather) for k, v in state.items()}
        states[index] = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in full.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if is_writer:
        Path(checkpoint).mkdir(parents=True, exist_ok=True)
        torch.save({"states": states, "groups": groups}, Path(checkpoint) / file_name)
    dist.barrier()


def load_full_optimizer(
    optimizer: Any,
    checkpoint: str | Path,
    *,
    shard_even: Callable[[dict, nn.Parameter, nn.Parameter], dict],
) -> None:
    """Load full states and shard each to its current parameter's layout (no communication).

    ``shard_even(state, working_param, param)`` slices a stock (even) TP parameter's state.
    """
    states: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for path in sorted(Path(checkpoint).glob(_PATTERN)):  # one per pipeline stage
        saved = torch.load(path, map_location=host_device(), weights_only=False)
        states.update(saved["states"])
        groups = saved["groups"]
    params = _params(optimizer)
    ids = _param_ids(optimizer, params)
    missing = [i for i in ids if i not in states]
    if missing:
        raise ValueError(
            f"{checkpoint}: optimizer checkpoint has no states for parameters {missing[:5]} of "
            f"this model ({len(states)} saved, {len(params)} here)"
        )
    for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
        group.update(saved_group)
    for index, (working, param) in zip(ids, params, strict=True):
        full = states[index]
        if not full:
            continue
        shard = _hooks(working)[0]
        if shard is None:
            local = shard_even(dict(full), working, param)
        else:
            local = {k: _shard(v, shard) for k, v in full.items()}
        optimizer.optim.state[param] = {
            k: v.to(device=param.device) if torch.is_tensor(v) and v.dim() > 0 else v
            for k, v in local.items()
        }


def _hooks(param: nn.Parameter) -> tuple[Callable | None, Callable | None]:
    """(shard, gather) that map a full HF tensor to ``param``'s local layout and back.

    Resizable layers carry a ``shard_layout``; some stock Colossal-AI layers (GPT-2's fused
    QKV, whose shards interleave Q, K and V) carry customized shard/gather hooks. Plain even
    splits carry neither and use Colossal-AI's even rule.
    """
    from colossalai.tensor.d_tensor.api import is_customized_distributed_tensor

    layout = layout_of(param)
    if layout is not None:
        return layout.shard, layout.gather
    if is_customized_distributed_tensor(param):
        return param.shard_fn, param.gather_fn  # type: ignore[attr-defined]
    return None, None


def _gather(value: Any, param: nn.Parameter, gather: Callable) -> Any:
    if torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0:
        return gather(value)
    return value


def _shard(value: Any, shard: Callable) -> Any:
    if torch.is_tensor(value) and value.dim() > 0:
        return shard(value)
    return value
