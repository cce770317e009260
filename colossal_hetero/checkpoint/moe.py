"""MoeCheckpointIO: checkpoints of expert-parallel runs (``parallel.ep > 1``), placement-free.

An expert-parallel rank holds the dense weights and only the experts its placement gives it
(moe/block.py; a speed-aware re-placement moves them between steps, moe/replace.py). Under
Colossal-AI's own ``MoECheckpointIO`` optimizer states are keyed by a parameter's position
in the optimizer, which a moved expert no longer has. Here everything is keyed by the
parameter's full Hugging Face name (``model.layers.1.block_sparse_moe.experts.3.w1.weight``),
which does not depend on where the expert lives:

- model: the ranks of one ep group (the one with ``moe_dp`` rank 0; the other data-parallel
  replicas hold the same values) send their experts to ep rank 0, which writes every tensor
  once, in Colossal-AI's (and Hugging Face's) file layout: shards plus
  ``pytorch_model.bin.index.json`` (or safetensors) and ``config.json`` when ``shard`` is
  true, one file otherwise. The folder loads into a single-process ``MixtralForCausalLM``.
  Loading reads, on every rank, the tensors of the parameters it holds now, by name, under
  any placement; a tensor missing from the checkpoint is an error.
- optimizer: ``<folder>/moe_optimizer.pt`` (or the file itself with ``shard`` false) =
  ``{"format": FORMAT, "states": {name: {key: value}}, "masters": {name: fp32 tensor},
  "groups": [hyperparameters]}``, gathered the same way. ``masters`` holds the fp32 master
  weights of mixed precision (which the bf16/fp16 model file cannot hold exactly).

Tensor parallelism around the experts (``parallel.tp > 1``, 1D, ``zero_stage`` 0): attention,
embeddings, router and LM head are Colossal-AI's 1D shards and each held expert is split over
the tp group (moe/block.py). Saving gathers every shard (weights, optimizer states, fp32
masters) over the tp group to its full Hugging Face shape (a padded vocabulary unpadded), and
only tp rank 0 sends on to the writer, so the files are the same as without tensor parallelism;
loading slices each rank's shard from the full tensor by the parameter's own 1D layout. A
checkpoint therefore moves between tp widths (and placements) in both directions.

Both optimizer paths: our reducers' (``parallel.zero_stage`` 0, the fp32 naive or AMP
wrapper) and Colossal-AI's ZeRO MoE optimizer (``zero_stage`` 1/2), whose flat, padded state
and master shards are gathered over each parameter's ZeRO group to full shapes on save and
sliced again on load; the file is the same either way, so a checkpoint also moves between them.

Memory: ep rank 0 holds every expert (and state) of the model at once while writing; fine
for the models this runs, not for a model whose experts do not fit one host's memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from colossalai.checkpoint_io import CheckpointIndexFile
from colossalai.checkpoint_io.utils import (
    StateDictSharder,
    get_model_base_filenames,
    load_shard_state_dict,
    save_config_file,
    save_state_dict,
    save_state_dict_shards,
)
from colossalai.tensor.d_tensor.api import (
    get_shard_dim_1d,
    is_customized_distributed_tensor,
    is_distributed_tensor,
)
from colossalai.tensor.moe_tensor.api import is_moe_tensor
from colossalai.tensor.padded_tensor import is_padded_tensor
from torch import nn
from torch.distributed import ProcessGroup

from colossal_hetero.checkpoint.io import HeteroCheckpointIO
from colossal_hetero.utils.collectives import all_gather_anywhere
from colossal_hetero.utils.device import host_device

FORMAT = "colossal_hetero.moe_optimizer.v1"
OPTIMIZER_FILE = "moe_optimizer.pt"


class MoeCheckpointIO(HeteroCheckpointIO):
    """Checkpoint IO of HeteroParallelPlugin with ``parallel.ep > 1`` (see the module)."""

    def __init__(
        self,
        global_dp_group: ProcessGroup,
        pp_group: ProcessGroup,
        tp_group: ProcessGroup,
        sp_group: ProcessGroup,
        zero_stage: int,
        *,
        ep_group: ProcessGroup,
        moe_dp_group: ProcessGroup,
    ) -> None:
        super().__init__(global_dp_group, pp_group, tp_group, sp_group, zero_stage)
        self.ep_group, self.moe_dp_group = ep_group, moe_dp_group
        self.ep_rank = dist.get_rank(ep_group)
        self.moe_dp_rank = dist.get_rank(moe_dp_group)
        self.zero_stage = zero_stage

    # -- model ------------------------------------------------------------------------------
    def save_model(self, model: Any, checkpoint: str, *args: Any, **kwargs: Any) -> None:
        self._require_layout("save")
        super().save_model(model, checkpoint, *args, **kwargs)

    def load_model(self, model: Any, checkpoint: str, *args: Any, **kwargs: Any) -> Any:
        self._require_layout("load")
        return super().load_model(model, checkpoint, *args, **kwargs)

    def save_sharded_model(
        self,
        model: Any,
        checkpoint: str,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = False,
        use_async: bool = False,
    ) -> None:
        """Every tensor once, by its HF name, in shards with an index and the HF config."""
        full = self._gathered_model(model)
        if full is not None:
            Path(checkpoint).mkdir(parents=True, exist_ok=True)
            weights_name, index_name = get_model_base_filenames(prefix, use_safetensors)
            index = CheckpointIndexFile(checkpoint)
            total = save_state_dict_shards(
                sharded_state_dict=_shards(full, size_per_shard),
                checkpoint=checkpoint,
                index_file=index,
                base_filename=weights_name,
                is_master=True,
                use_safetensors=use_safetensors,
            )
            index.append_meta_data("total_size", total)
            index.write_index_file(index_name)
            save_config_file(model.unwrap(), checkpoint)
        dist.barrier()

    def save_unsharded_model(
        self,
        model: Any,
        checkpoint: str,
        gather_dtensor: bool = True,
        use_safetensors: bool = False,
        use_async: bool = False,
    ) -> None:
        """Every tensor once, by its HF name, in the one file ``checkpoint``."""
        full = self._gathered_model(model)
        if full is not None:
            Path(checkpoint).parent.mkdir(parents=True, exist_ok=True)
            save_state_dict(full, checkpoint, use_safetensors=use_safetensors)
        dist.barrier()

    def load_sharded_model(
        self,
        model: Any,
        checkpoint_index_file: Any,
        strict: bool = False,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """The tensors this rank holds now (any placement), by name, from the shards."""
        index = CheckpointIndexFile.from_file(checkpoint_index_file)
        safetensors = "safetensors" in Path(checkpoint_index_file).name
        files: dict[str, dict[str, torch.Tensor]] = {}

        def tensor(name: str) -> torch.Tensor | None:
            if name not in index.weight_map:
                return None
            file = index.weight_map[name]
            if file not in files:
                path = Path(index.root_path) / file
                files[file] = load_shard_state_dict(path, use_safetensors=safetensors)
            return files[file][name]

        _copy_into(model, tensor, str(checkpoint_index_file), self._local, self._full_shape)

    def load_unsharded_model(
        self,
        model: Any,
        checkpoint: str,
        strict: bool = False,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """The tensors this rank holds now (any placement), by name, from one file."""
        from colossalai.checkpoint_io.utils import load_state_dict

        saved = load_state_dict(str(checkpoint))
        _copy_into(model, saved.get, checkpoint, self._local, self._full_shape)

    def _gathered_model(self, model: Any) -> dict[str, torch.Tensor] | None:
        """The whole model by HF name on the writer (None elsewhere); collective over the tp
        groups of ``moe_dp`` rank 0 (full shapes), then over the ep group of its tp rank 0."""
        if self.moe_dp_rank != 0:
            return None
        held = _held(model.unwrap())
        if self.ep_rank != 0:  # experts only: the dense tensors are the writer's too
            held = {n: p for n, p in held.items() if is_moe_tensor(p)}
        mine = {n: self._full(p, p.detach()).cpu() for n, p in held.items()}
        if self.tp_rank != 0:  # its tp rank 0 holds the same full tensors now
            return None
        return self._to_writer(mine)

    # -- optimizer --------------------------------------------------------------------------
    def save_optimizer(
        self, optimizer: Any, checkpoint: str, shard: bool = False, *args: Any, **kwargs: Any
    ) -> None:
        """States and fp32 masters by HF name (``shard``: in ``checkpoint/moe_optimizer.pt``,
        else in the file ``checkpoint``)."""
        self._require_layout("save")
        saved = None
        zero = self.zero_stage > 0  # every rank gathers its ZeRO shards: all take part
        if zero or self.moe_dp_rank == 0:
            local = _named_states(optimizer, dense=self.ep_rank == 0, zero=zero, full=self._full)
        if self.moe_dp_rank == 0 and self.tp_rank == 0:
            parts = self._to_writer(local)
            if parts is not None:
                saved = _merge(parts, optimizer)
        if saved is not None:
            path = Path(checkpoint) / OPTIMIZER_FILE if shard else Path(checkpoint)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(saved, path)
        dist.barrier()

    def load_optimizer(self, optimizer: Any, checkpoint: str, *args: Any, **kwargs: Any) -> None:
        """The states of the parameters this rank's optimizer steps now (any placement)."""
        self._require_layout("load")
        path = Path(checkpoint)
        path = path / OPTIMIZER_FILE if path.is_dir() else path
        if not path.is_file():
            raise ValueError(
                f"{checkpoint}: no {OPTIMIZER_FILE}; an expert-parallel optimizer loads only "
                "the format this plugin's expert-parallel checkpoint IO saves"
            )
        saved = torch.load(path, map_location=host_device(), weights_only=False)
        if saved.get("format") != FORMAT:
            raise ValueError(f"{path}: not an expert-parallel optimizer checkpoint ({FORMAT})")
        _load_named_states(optimizer, saved, str(path), zero=self.zero_stage > 0, local=self._local)
        dist.barrier()

    # -- helpers ----------------------------------------------------------------------------
    def _require_layout(self, action: str) -> None:
        """Refused before any collective, on every rank: pipeline stages, and ZeRO shards of
        tensor-parallel shards (config checks refuse both layouts to run at all)."""
        if self.pp_size > 1 or (self.tp_size > 1 and self.zero_stage > 0):
            raise ValueError(
                f"parallel.pp: cannot {action} an expert-parallel checkpoint with pipeline "
                f"parallelism or with ZeRO under tensor parallelism (pp={self.pp_size}, "
                f"tp={self.tp_size}, zero_stage={self.zero_stage}); it needs pp = 1 and, with "
                "tp > 1, zero_stage 0"
            )

    def _full(self, working: torch.Tensor, value: Any) -> Any:
        """``value`` (this rank's tp shard of ``working``, or a value shaped like it: a state,
        a master) gathered to the full HF shape; anything else as it is. Collective over the
        tp group for a sharded parameter (tp peers call it in the same order)."""
        if self.tp_size == 1 or not _like(value, working.shape):
            return value
        _require_1d(working)
        if is_distributed_tensor(working):
            parts = all_gather_anywhere(value, self.tp_group)
            value = torch.cat(parts, dim=get_shard_dim_1d(working))
        if is_padded_tensor(working):  # a padded vocabulary: the HF rows only
            dim, length, _ = _padding(working)
            value = value.narrow(dim, 0, length)
        return value

    def _local(self, working: torch.Tensor, full: Any) -> Any:
        """This rank's tp shard of a full-shaped ``full`` (the inverse of :meth:`_full`, no
        communication); anything else (``step``) as it is."""
        if self.tp_size == 1 or not _like(full, self._full_shape(working)):
            return full
        if is_padded_tensor(working):  # zero rows up to the padded length
            dim, _, padded = _padding(working)
            pad = list(full.shape)
            pad[dim] = padded - full.shape[dim]
            full = torch.cat([full, full.new_zeros(pad)], dim=dim)
        if is_distributed_tensor(working):
            full = full.chunk(self.tp_size, dim=get_shard_dim_1d(working))[self.tp_rank]
        return full.clone()

    def _full_shape(self, working: torch.Tensor) -> torch.Size:
        """The HF shape of ``working`` (its own shape unless tp-sharded or padded)."""
        if self.tp_size == 1:
            return working.shape
        _require_1d(working)
        shape = list(working.shape)
        if is_distributed_tensor(working):
            shape[get_shard_dim_1d(working)] *= self.tp_size
        if is_padded_tensor(working):
            dim, length, _ = _padding(working)
            shape[dim] = length
        return torch.Size(shape)

    def _to_writer(self, mine: dict[str, Any]) -> dict[str, Any] | None:
        """Merge every ep rank's ``mine`` on ep rank 0 (returned there, None elsewhere)."""
        writer = dist.get_global_rank(self.ep_group, 0)
        parts: list[Any] | None = [None] * dist.get_world_size(self.ep_group)
        if self.ep_rank != 0:
            parts = None
        dist.gather_object(mine, parts, dst=writer, group=self.ep_group)
        if parts is None:
            return None
        return {key: value for part in parts for key, value in part.items()}


def _shards(full: dict[str, torch.Tensor], size_mb: int) -> Iterator[tuple[dict, float]]:
    sharder = StateDictSharder(size_mb)
    for name, tensor in full.items():
        block, size = sharder.append_param(name, tensor)
        if block is not None:
            yield block, size
    yield sharder.current_block, sharder.current_block_size


def _held(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of ``module`` by name (no gathering)."""
    held: dict[str, torch.Tensor] = dict(module.named_parameters())
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                held.setdefault(f"{prefix}.{name}" if prefix else name, buffer)
    return held


def _copy_into(model: Any, tensor: Any, source: str, local: Any, full_shape: Any) -> None:
    """Copy ``tensor(name)`` (its tp shard: ``local(target, value)``) into every parameter and
    persistent buffer ``model`` holds; nothing is copied unless every rank finds all of its
    tensors with the right full shapes (``full_shape(target)``)."""
    held = _held(model.unwrap())
    values = {name: tensor(name) for name in held}
    wrong = [
        f"{name} (saved {tuple(v.shape)}, here {tuple(full_shape(held[name]))})"
        if v is not None
        else name
        for name, v in values.items()
        if v is None or v.shape != full_shape(held[name])
    ]
    _agree_missing(wrong, f"{source}: no tensor (or a wrong shape) for")
    with torch.no_grad():
        for name, target in held.items():
            target.copy_(local(target, values[name]))
    model.update_master_params()  # mixed precision: masters from the loaded weights


def _like(value: Any, shape: torch.Size) -> bool:
    """Whether ``value`` is a per-element tensor of a parameter of ``shape`` (not ``step``)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == shape


def _padding(working: torch.Tensor) -> tuple[int, int, int]:
    """(dim, HF length, padded length) of a padded (vocabulary) parameter."""
    dim, length = working._padding_dim, working._origin_length  # type: ignore[attr-defined]
    return dim, length, working._current_length  # type: ignore[attr-defined]


def _require_1d(working: torch.Tensor) -> None:
    if is_customized_distributed_tensor(working):  # e.g. GPT-2's fused QKV, not Mixtral's
        raise ValueError(
            "parallel.tp: an expert-parallel checkpoint gathers plain 1D shards only, got a "
            f"parameter of shape {tuple(working.shape)} with custom shard functions"
        )


def _agree_missing(missing: list[str], message: str) -> None:
    """One ValueError on every rank when any rank misses something (one small collective):
    ranks hold different experts, so only some would notice alone."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(missing))
    every = sorted({name for part in everyone for name in part})
    if every:
        raise ValueError(f"{message} {every[:3]} ({len(every)} missing)")


def _names(optimizer: Any) -> dict[int, str]:
    """id(parameter the optimizer steps) -> the HF name of its working parameter."""
    module = optimizer.model.unwrap()
    by_working = {id(p): n for n, p in module.named_parameters()}
    to_working = optimizer.get_master_to_working_map() or {}
    return {
        id(p): by_working[id(to_working.get(id(p), p))]
        for group in optimizer.param_groups
        for p in group["params"]
    }


def _named_states(optimizer: Any, *, dense: bool, zero: bool, full: Any) -> dict[str, Any]:
    """``{name: (state, master or None)}`` of this rank's experts (and dense parameters),
    full-shaped. ``zero``: each state and master is gathered from its ZeRO group (collective:
    every rank calls this; dense parameters first, then experts, in optimizer order); then
    ``full(working, value)`` gathers a tp shard (collective over the tp group)."""
    names = _names(optimizer)
    to_working = optimizer.get_master_to_working_map() or {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    moe = [is_moe_tensor(to_working.get(id(p), p)) for p in params]
    out: dict[str, Any] = {}
    for expert_pass in (False, True):
        for param, is_expert in zip(params, moe, strict=True):
            if is_expert != expert_pass or not (zero or dense or is_expert):
                continue
            working = to_working.get(id(param), param)
            state = optimizer.optim.state.get(param, {})
            master = None if working is param else param.detach()
            if zero:
                state = {k: _zero_full(optimizer, param, v) for k, v in state.items()}
                master = _zero_full(optimizer, param, param.detach())
            if dense or is_expert:
                copied = {k: _cpu(full(working, v)) for k, v in state.items()}
                master = None if master is None else _cpu(full(working, master))
                out[names[id(param)]] = (copied, master)
    return out


def _zero_full(optimizer: Any, param: Any, value: Any) -> Any:
    """A ZeRO shard of ``param`` (flat, a padded slice over the parameter's group) gathered to
    the working parameter's shape; other values (``step``) as they are."""
    if not (torch.is_tensor(value) and value.dim() == 1 and value.numel() == param.numel()):
        return value
    working = optimizer.get_master_to_working_map()[id(param)]
    group = optimizer.param_to_pg[working]
    parts = all_gather_anywhere(value, group)
    return torch.cat(parts)[: working.numel()].view(working.shape)


def _zero_shard(optimizer: Any, param: Any, full: torch.Tensor) -> torch.Tensor:
    """This rank's ZeRO slice of a full-shaped ``full`` (the inverse of :func:`_zero_full`)."""
    working = optimizer.get_master_to_working_map()[id(param)]
    if full.shape != working.shape:
        return full  # not a per-element state (``step``)
    group = optimizer.param_to_pg[working]
    size = dist.get_world_size(group)
    flat = torch.nn.functional.pad(full.reshape(-1), [0, param.numel() * size - full.numel()])
    return flat.chunk(size)[dist.get_rank(group)].clone()


def _cpu(value: Any) -> Any:
    return value.detach().cpu().clone() if torch.is_tensor(value) else value


def _merge(parts: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {
        "format": FORMAT,
        "states": {name: state for name, (state, _) in parts.items()},
        "masters": {name: m for name, (_, m) in parts.items() if m is not None},
        "groups": groups,
    }


def _load_named_states(
    optimizer: Any, saved: dict[str, Any], source: str, zero: bool, local: Any
) -> None:
    """Each stepped parameter's state and master by name: its tp shard (``local(working,
    full)``), then its ZeRO slice (``zero``)."""
    if len(saved["groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"{source}: {len(saved['groups'])} parameter groups saved, the optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    names = _names(optimizer)
    to_working = optimizer.get_master_to_working_map() or {}
    missing = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    missing = [n for n in missing if n not in saved["states"]]
    _agree_missing(missing, f"{source}: no optimizer state for")
    for group, hyper in zip(optimizer.param_groups, saved["groups"], strict=True):
        group.update(hyper)
        for param in group["params"]:
            name, working = names[id(param)], to_working.get(id(param), param)
            state = {k: local(working, v) for k, v in saved["states"][name].items()}
            master = saved["masters"].get(name)
            master = None if master is None else local(working, master)
            if zero:
                state = {
                    k: _zero_shard(optimizer, param, v) if torch.is_tensor(v) else v
                    for k, v in state.items()
                }
                master = None if master is None else _zero_shard(optimizer, param, master)
            _set_state(optimizer.optim, param, state)
            if master is not None:
                with torch.no_grad():
                    param.copy_(master)


def _set_state(optim: torch.optim.Optimizer, param: nn.Parameter, state: dict) -> None:
    if not state:
        optim.state.pop(param, None)
        return
    optim.state[param] = {
        k: _placed(v, param.device) if torch.is_tensor(v) else v for k, v in state.items()
    }


def _placed(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of a loaded state tensor: on the parameter's device, scalars (``step``) on the
    CPU as torch's optimizers keep them."""
    return value.clone().to(device) if value.dim() > 0 else value.clone()
