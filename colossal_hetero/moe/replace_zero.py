"""Expert re-placement under ZeRO: the bookkeeping of Colossal-AI's MoE ZeRO optimizer.

Under ``parallel.zero_stage`` 1 (and 2, which Colossal-AI's ``MoeHybridParallelPlugin`` runs
as 1: no gradient partitioning, no overlapped reduction) the optimizer is
``MoeHybridParallelZeroOptimizer`` (a ``LowLevelZeroOptimizer``). Each working (bf16/fp16)
expert parameter is whole on every rank that holds the expert; its fp32 master is one flat,
padded slice of it per rank of the expert's ZeRO group (``moe_dp``: the ranks holding the same
experts), and the torch optimizer steps the slices (groups and state keyed by them).

Why a move stays exact without re-sharding: Colossal-AI's mesh makes the ep group a set of
ranks with one ``moe_dp`` coordinate, and every ``moe_dp`` group has the same size. The old
holder with ``moe_dp`` rank ``i`` sends to the new holder with ``moe_dp`` rank ``i`` (same
ep group), whose slice of the same parameter (same element count, same padding) is slice
``i``: the master slice and its optimizer state travel as they are, point to point, and the
new holder's ZeRO group (its own ``moe_dp`` group) reads them back in the same order. The
layout ``(moe_dp rank, group size, padding)`` is checked on both sides of every move.

What refers to a working parameter (``w``) or its master slice (``m``), every entry of which
:meth:`ZeroExperts.release` drops and :meth:`ZeroExperts.adopt` creates:

- ``_working_param_groups[g]`` / ``_master_param_groups_of_current_rank[g]`` (aligned lists;
  the torch optimizer's ``param_groups[g]["params"]`` is the masters' list) and
  ``optim.state[m]``;
- ``working_to_master_param[id(w)]``, ``master_to_working_param[id(m)]``, ``_padding_map[id(w)]``,
  ``_working_param_to_padded_working_param[w]`` (the padded flat buffer ``w`` is a view of: the
  step's all-gather writes the updated slices into it);
- ``param_to_pg[w]``, ``pg_to_param_list[pg]``, ``pid_to_grad_store[id(w)]``,
  ``pid_to_bucket_store[id(w)]``, and a gradient store's leftover slices of ``w`` (kept from
  the last step until ``zero_grad``).

Afterwards the lists are put back in the model's parameter order, which a fresh optimizer
built at the new placement has. Refused (ValueError): reduction hooks (overlapped
communication or partitioned gradients: not what the MoE plugin builds), overlapped
all-gather, Colossal-AI's distributed optimizers (their own shard maps), a bucket still
holding gradients (a move runs between steps only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer
from torch import nn


def is_zero(optimizer: Any) -> bool:
    """Whether ``optimizer`` is Colossal-AI's ZeRO optimizer (``zero_stage`` > 0)."""
    return isinstance(optimizer, LowLevelZeroOptimizer)


class ZeroExperts:
    """A ZeRO optimizer as an expert move sees it (the interface of moe/replace.py's
    ``_Optimizer``): masters are the flat fp32 slices this rank steps."""

    def __init__(self, optimizer: LowLevelZeroOptimizer) -> None:
        self.zero: Any = optimizer
        self.inner: torch.optim.Optimizer = optimizer.optim
        groups = list(optimizer.pg_to_param_list)
        # MoeHybridParallelZeroOptimizer lists the dense group first, then moe_dp (one
        # group when they are the same): the experts' ZeRO group is the last.
        self.pg = groups[-1]
        self.rank, self.size = dist.get_rank(self.pg), dist.get_world_size(self.pg)

    def check_between_steps(self) -> None:
        """Refuse what a move cannot keep exact (see the module)."""
        from colossalai.interface.optimizer import DistributedOptim

        zero = self.zero
        refused = (
            (
                zero.grad_handles or zero._partition_grads or zero._overlap_communication,
                "gradient reduction hooks (partitioned gradients or overlapped communication)",
            ),
            (zero._overlap_allgather, "overlapped all-gather"),
            (isinstance(self.inner, DistributedOptim), "a distributed optimizer"),
        )
        for bad, what in refused:
            if bad:
                raise ValueError(
                    "parallel.zero_stage: expert re-placement (moe.replace_every) under ZeRO "
                    f"does not support {what}"
                )
        if any(store.num_elements_in_bucket() for store in zero.pg_to_bucket_store.values()):
            raise RuntimeError("expert re-placement: gradients still bucketed (move between steps)")

    def layout(self, numel: int) -> tuple[int, int, int]:
        """(rank in the experts' ZeRO group, its size, padding) of a parameter of ``numel``."""
        return self.rank, self.size, (self.size - numel % self.size) % self.size

    def master(self, param: nn.Parameter) -> torch.Tensor:
        master: torch.Tensor = self.zero.working_to_master_param[id(param)]
        return master

    def state(self, param: nn.Parameter) -> dict[str, Any]:
        return self.inner.state.get(self.master(param), {})

    def release(self, param: nn.Parameter) -> None:
        """Forget ``param``: it and its master slice leave every structure (see the module)."""
        zero = self.zero
        master = zero.working_to_master_param.pop(id(param))
        del zero.master_to_working_param[id(master)]
        for g, working in zero._working_param_groups.items():
            at = [i for i, p in enumerate(working) if p is param]
            if at:
                masters = zero._master_param_groups_of_current_rank[g]
                assert masters[at[0]] is master, "ZeRO working and master lists out of step"
                del working[at[0]], masters[at[0]]
        self.inner.state.pop(master, None)
        del zero._padding_map[id(param)]
        del zero._working_param_to_padded_working_param[param]
        pg = zero.param_to_pg.pop(param)
        zero.pg_to_param_list[pg] = [p for p in zero.pg_to_param_list[pg] if p is not param]
        del zero.pid_to_grad_store[id(param)], zero.pid_to_bucket_store[id(param)]
        for store in zero.pg_to_grad_store.values():  # slices left from the last step
            for grads in store._grads_of_params.values():
                grads.pop(id(param), None)
            mapping = store.grad_to_param_mapping
            store.grad_to_param_mapping = {k: v for k, v in mapping.items() if v != id(param)}

    def adopt(
        self, param: nn.Parameter, master: torch.Tensor, group: int | None, state: dict[str, Any]
    ) -> None:
        """Step ``param`` (whole, received) through ``master`` (this rank's received slice)."""
        if group is None:
            raise ValueError("expert re-placement under ZeRO: a moved parameter has no group")
        zero, numel = self.zero, param.numel()
        padding = self.layout(numel)[2]
        with torch.no_grad():
            flat = param.data.reshape(-1)
            padded = F.pad(flat, [0, padding]) if padding else flat
            param.data = padded[:numel].view(param.shape)
        zero._working_param_to_padded_working_param[param] = padded
        zero._padding_map[id(param)] = padding
        zero.link_master_and_working_param(master, param)
        zero.param_to_pg[param] = self.pg
        zero.pg_to_param_list[self.pg].append(param)
        zero.pid_to_grad_store[id(param)] = zero.pg_to_grad_store[self.pg]
        zero.pid_to_bucket_store[id(param)] = zero.pg_to_bucket_store[self.pg]
        zero._working_param_groups[group].append(param)
        zero._master_param_groups_of_current_rank[group].append(master)
        if state:
            self.inner.state[master] = state

    def finish(self) -> None:
        """The model's parameter order in every list (as a fresh build at this placement);
        the torch optimizer's groups step the masters' lists again."""
        zero = self.zero
        order = {id(p): i for i, p in enumerate(zero.model.parameters())}
        for g, working in zero._working_param_groups.items():
            masters = zero._master_param_groups_of_current_rank[g]
            pairs = sorted(zip(working, masters, strict=True), key=lambda wm: order[id(wm[0])])
            working[:] = [w for w, _ in pairs]
            masters[:] = [m for _, m in pairs]
            self.inner.param_groups[g]["params"] = masters
        for params in zero.pg_to_param_list.values():
            params.sort(key=lambda p: order[id(p)])
