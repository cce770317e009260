"""Full Hugging Face tensors <-> a rank's 2D blocks, for checkpoints and optimizer states.

Every parameter of a converted model carries Colossal-AI's customized-distributed-tensor hooks
(``shard_fn`` / ``gather_fn``, colossalai.tensor.d_tensor.api), so its checkpoint IO (model
shards, ``gather_distributed_param``) and ours (full optimizer states,
checkpoint/optimizer_state.py) move full HF tensors without knowing about meshes:

- ``shard_fn(full)``: the full HF tensor -> this rank's block (no communication);
- ``gather_fn(block)``: this rank's block -> the full HF tensor on every rank of the mesh
  (column then row broadcasts; collective over the mesh, so every rank of the mesh calls it
  for the same parameters in the same order, as Colossal-AI's IO does).

A converted model's ``state_dict()`` holds full tensors and ``load_state_dict`` takes full
tensors (``install_full_state_dict``), like Colossal-AI's sharded modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from colossalai.tensor.d_tensor.api import customized_distributed_tensor_to_existing_param
from torch import nn

from colossal_hetero.tp2d import comm2d
from colossal_hetero.tp2d.layers import dense_block, dense_vector_block
from colossal_hetero.tp2d.mesh import Mesh2D

SPEC_ATTR = "tp2d_spec"


@dataclass(frozen=True)
class BlockSpec:
    """How a full HF tensor maps to rank (i, j)'s block.

    ``rows``: sizes cutting dim 0 over mesh rows, or None for a tensor replicated down each
    mesh column (vectors, the position table). ``cols``: sizes cutting the last dim over mesh
    columns, per fused part; ``parts``: fused parts along the last dim ([Q | K | V]: 3).
    ``transpose``: the HF tensor is the transpose of the block's matrix (nn.Linear's
    [out, in] against the 2D layers' [in, out]). ``full_shape``: the HF tensor's shape when
    it is not 2-D (a convolution [out, c, k, k] seen as the matrix [out, c * k * k]).
    """

    mesh: Mesh2D
    rows: tuple[int, ...] | None
    cols: tuple[int, ...]
    parts: int = 1
    transpose: bool = False
    full_shape: tuple[int, ...] | None = None

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """Full HF tensor -> this rank's block (a contiguous copy)."""
        matrix = full if self.full_shape is None else full.reshape(full.shape[0], -1)
        matrix = matrix.t() if self.transpose else matrix
        i, j = self.mesh.i, self.mesh.j
        if self.rows is None:
            return dense_vector_block(matrix, self.cols, j, self.parts)
        return dense_block(matrix, self.rows, self.cols, i, j, self.parts)

    def gather(self, block: torch.Tensor) -> torch.Tensor:
        """This rank's block -> the full HF tensor (collective over the mesh)."""
        with torch.no_grad():
            x = block.detach()
            if self.rows is not None:
                x = comm2d.gather_blocks(x.contiguous(), self.mesh, "col", 0, self.rows)
            widths = [self.parts * c for c in self.cols]
            x = comm2d.gather_blocks(x.contiguous(), self.mesh, "row", x.dim() - 1, widths)
            if self.parts > 1:  # [Q0 K0 V0 | Q1 K1 V1] -> [Q0 Q1 | K0 K1 | V0 V1]
                pieces = [
                    p.split(c, -1) for p, c in zip(x.split(widths, -1), self.cols, strict=True)
                ]
                x = torch.cat(
                    [pieces[t][p] for p in range(self.parts) for t in range(len(pieces))], -1
                )
            x = x.t().contiguous() if self.transpose else x.contiguous()
            return x if self.full_shape is None else x.reshape(self.full_shape)


def mark(param: nn.Parameter, spec: BlockSpec) -> None:
    """Attach ``spec`` and Colossal-AI's shard/gather hooks to ``param`` (keeps its data)."""
    data = param.data
    data.shard_fn = spec.shard  # type: ignore[attr-defined]
    data.gather_fn = spec.gather  # type: ignore[attr-defined]
    customized_distributed_tensor_to_existing_param(data, param)
    setattr(param, SPEC_ATTR, spec)


def spec_of(param: torch.Tensor) -> BlockSpec | None:
    """The BlockSpec of a 2D parameter, else None."""
    return getattr(param, SPEC_ATTR, None)


def is_model_2d(model: Any) -> bool:
    """Whether ``model`` (unwrapped) holds 2D parameters."""
    return isinstance(model, nn.Module) and any(spec_of(p) is not None for p in model.parameters())


def has_2d_params(optimizer: Any) -> bool:
    """Whether any parameter an optimizer steps is a 2D block."""
    return any(spec_of(p) is not None for g in optimizer.param_groups for p in g["params"])


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full HF tensor, keyed by name (collective over the mesh)."""
    out = {}
    for name, param in model.named_parameters():
        spec = spec_of(param)
        out[name] = spec.gather(param) if spec is not None else param.detach().clone()
    return out


def install_full_state_dict(model: nn.Module) -> None:
    """Make ``model.state_dict()`` gather full HF tensors and ``load_state_dict`` shard them.

    state_dict: collective over the mesh (every rank of the mesh calls it). load_state_dict:
    no communication; a tensor of the full shape is cut to this rank's block, one already of
    the block's shape is taken as is.
    """
    specs = {name: spec_of(p) for name, p in model.named_parameters()}
    blocks = {name: tuple(p.shape) for name, p in model.named_parameters()}

    def gather_hook(module: nn.Module, state: dict, prefix: str, _meta: Any) -> None:
        for name, spec in specs.items():
            key = prefix + name
            if spec is not None and key in state:
                state[key] = spec.gather(state[key])

    def shard_hook(module: nn.Module, state: dict, prefix: str, *_: Any) -> None:
        for name, spec in specs.items():
            key = prefix + name
            value = state.get(key)
            if spec is None or value is None or tuple(value.shape) == blocks[name]:
                continue
            state[key] = spec.shard(value)

    model._register_state_dict_hook(gather_hook)
    model.register_load_state_dict_pre_hook(shard_hook)
