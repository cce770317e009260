"""The global gradient norm of an expert-parallel model, for clipping at ``zero_stage`` 0.

After the flush (moe/wiring.py) every rank holds reduced gradients: the dense ones, the same
on every data-parallel rank, and those of its own experts, the same on the replicas of that
expert group (``moe_dp``) and absent elsewhere. The norm a single process would clip by is
over every dense parameter once and every expert once, so each rank adds

- its dense gradients' ``|g|^p`` only if it is rank 0 of the dense group, and
- its experts' only if it is rank 0 of its expert group,

and one all-reduce (SUM; MAX for the inf-norm, where repeats do not matter) over the dense
group gives every rank the same total. Counting a representative instead of dividing every
rank's share by its number of copies keeps the sum exact. The all-reduce is issued on every
rank at every clipped step, even with no gradients here, so the group's collectives stay in
step; the dense group is idle then (the flush waited for all its chunks).

With tensor parallelism (``parallel.tp > 1``) the dense group holds one tp index, so the sum
runs over a group of every rank instead, and a parameter replicated over the tp group (no
Colossal-AI sharding spec: norms, a row-parallel bias) is added on tp rank 0 only, while each
tp shard (``is_distributed_tensor``: attention, embeddings, router, every expert slice) is
added by its own tp rank: every shard once, every replicated parameter once.

The Colossal-AI wrapper (``HybridParallelNaiveOptimizer`` or ``HybridParallelAMPOptimizer``)
then clips by ``max_norm / (norm + 1e-6)``, capped at 1, as ``torch.nn.utils.clip_grad_norm_``
does; :func:`install_ep_grad_norm` replaces only its norm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from colossalai.tensor.d_tensor import is_distributed_tensor
from torch.distributed import ProcessGroup

from colossal_hetero.moe.scheduler import ChunkedGradReducer
from colossal_hetero.utils.collectives import all_reduce_anywhere

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]
"""(working parameter, gradient) pairs, as the wrappers pass them to ``_compute_grad_norm``."""


def ep_grad_norm(
    pairs: Pairs,
    expert_ids: set[int],
    group: ProcessGroup,
    count: tuple[bool, bool],
    norm_type: float = 2.0,
    device: torch.device | None = None,
    tp_first: bool = True,
) -> float:
    """The global ``norm_type``-norm of the gradients in ``pairs`` over ``group`` (collective).

    ``expert_ids``: ids of the expert parameters (the rest are dense); ``count``: whether this
    rank adds its (dense, expert) gradients (see the module); ``tp_first``: whether it is tp
    rank 0, which alone adds parameters replicated over the tp group (True without TP); a
    p-norm adds ``|g|^p`` in float64, the inf-norm takes the largest ``|g|``. ``device``:
    where the all-reduced scalar lives (the parameters' device; CPU by default).
    """
    if norm_type <= 0:
        raise ValueError(f"gradient norm: norm_type must be > 0, got {norm_type}")
    count_dense, count_expert = count
    kept = [
        g
        for p, g in pairs
        if (count_expert if id(p) in expert_ids else count_dense)
        and (tp_first or is_distributed_tensor(p))
    ]
    if math.isinf(norm_type):
        local = max((float(g.detach().abs().max()) for g in kept if g.numel()), default=0.0)
        total = torch.tensor([local], dtype=torch.float64, device=device)
        all_reduce_anywhere(total, dist.ReduceOp.MAX, group)
        return float(total)
    local = sum(float(g.detach().double().norm(norm_type) ** norm_type) for g in kept)
    total = torch.tensor([local], dtype=torch.float64, device=device)
    all_reduce_anywhere(total, group=group)
    return float(total) ** (1.0 / norm_type)


def install_ep_grad_norm(
    optimizer: Any,
    reducers: dict[str, ChunkedGradReducer],
    tp_group: ProcessGroup | None = None,
    norm_group: ProcessGroup | None = None,
) -> None:
    """Make the boosted ``optimizer`` (Colossal-AI's wrapper) clip by the global norm: its
    ``_compute_grad_norm`` becomes :func:`ep_grad_norm` over the reducers' groups. The expert
    parameters are read from the expert reducer at each step (re-placement rebinds it).
    With TP, ``tp_group`` is this rank's tp group and ``norm_group`` a group of every rank
    (the sum's group; the dense group otherwise)."""
    dense, expert = reducers["dense"], reducers["expert"]
    count = (dist.get_rank(dense.group) == 0, dist.get_rank(expert.group) == 0)
    tp_first = tp_group is None or dist.get_rank(tp_group) == 0
    group = dense.group if norm_group is None else norm_group
    params = dense.parameters + expert.parameters
    device = params[0].device if params else None

    def compute(pairs: Pairs, norm_type: float = 2.0) -> float:
        expert_ids = {id(p) for p in expert.parameters}
        norm = float(norm_type)
        return ep_grad_norm(pairs, expert_ids, group, count, norm, device, tp_first)

    optimizer._compute_grad_norm = compute
