"""Wiring of expert parallelism into the plugin: policy before sharding, reducers after.

The plugin (a composition root) calls :func:`moe_policy` at ``configure`` before the engine
shards the model, and :func:`install_reducers` after, with the boosted model and optimizer.
The reducers then run on the step seam:

- gradients of dense parameters are reduced over all data-parallel ranks, those of the experts
  a rank holds over the ranks holding the same experts (``moe_dp``), both averaged over all
  data-parallel ranks (with ``parallel.tp > 1``: per tp index, each tp shard over the ranks
  holding the same shard), in fixed chunks, on process groups of their own (never the a2a's);
  each group's all-reduce cost is profiled once (moe/profile.py) to predict chunk times and,
  with ``moe.chunk_auto``, to size the chunks (``ChunkedGradReducer.size_over_runs``, as
  ``bench moe`` does: the size, at most ``moe.chunk_kib``, judged by the chunks its plan over
  the group's phase runs makes, re-chosen once the dense order is learnt; for the dense group
  without expert replicas :func:`chosen_chunk_bytes`, the rule of moe/chunks.py's
  ``choose_chunk_bytes`` over the whole gradient, with at least ``MIN_CHUNKS``); a given
  size is evened out over the group's gradient (``max(1, total // size)`` equal chunks, so no
  small tail chunk pays a whole all-reduce latency); for the dense group without expert
  replicas at least ``MIN_CHUNKS``, each at least ``MIN_CHUNK_BYTES``; the dense chunks follow
  the order backward produced the gradients in, agreed in the first flush (``learn_order``,
  moe/scheduler.py), and break where an a2a came between two gradients; the expert chunks
  break between MoE layers (:func:`expert_layers`), so no chunk waits for a later layer;
- the boosted optimizer's ``step`` first flushes both reducers, so every gradient is reduced
  before the update (and before clipping); a group reduced while the other is still on the
  wire is stepped then, on its own, where that is the same update (moe/split_step.py);
- gradient accumulation: the reducers sync only while the boosted model's
  ``require_grad_sync`` is on, so micro-steps under ``booster.no_sync(model, optimizer)``
  accumulate locally and the last one (outside it) reduces the sum, chunked and prioritised;
- clipping (``parallel.max_norm``): the wrapper's norm is replaced by the global one over
  dense and expert gradients (moe/clip.py), one all-reduce after the flush;
- :class:`MoeStepLog`, a seam controller, starts each step's event log and, with a metrics
  folder, writes it as one record per step to ``moe_rank{r}.jsonl`` (with the placement in
  the first record); with ``moe.pipeline_auto`` it feeds the pipelining choice
  (moe/pipeline_choice.py) the first steps' logs and logs the decision in that step's record.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from colossal_hetero.config.schema import HeteroConfig
from colossal_hetero.metrics.decisions import DecisionWriter
from colossal_hetero.moe.block import HeteroEPMixtralSparseMoeBlock
from colossal_hetero.moe.checks import check_moe_model
from colossal_hetero.moe.chunks import choose_chunk_bytes, even_chunk_bytes
from colossal_hetero.moe.clip import install_ep_grad_norm
from colossal_hetero.moe.comm import MoeComm
from colossal_hetero.moe.pipeline_choice import PipelineChooser
from colossal_hetero.moe.placement import Placement
from colossal_hetero.moe.policy import HeteroMixtralForCausalLMPolicy
from colossal_hetero.moe.profile import profile_groups
from colossal_hetero.moe.scheduler import ChunkedGradReducer
from colossal_hetero.moe.split_step import flush_then_step


@dataclass(frozen=True, slots=True)
class MoeSetup:
    """What ``configure`` builds before sharding: the policy, its gate and the placement."""

    policy: HeteroMixtralForCausalLMPolicy
    comm: MoeComm
    placement: Placement


MIN_CHUNK_BYTES = 16384
"""Floor of a profiled chunk size (a noisy profile can put alpha near 0)."""

MIN_CHUNKS = 4
"""Fewest dense chunks when no expert gradient is reduced (every expert on one rank: EP=4 on 4
ranks): the dense gradient (396 KB against a profiled 280 KiB chunk there) is cut finer, so
that its first chunks, ready early in backward, go out between a2a's instead of all of it at
the end. Not with expert replicas (EP=2 x DP=2): smaller chunks measured slower there."""


def moe_policy(config: HeteroConfig, model: nn.Module, world_size: int) -> MoeSetup:
    """Check the model against ``parallel.ep`` and ``moe`` (ConfigError, on every rank, before
    any collective) and build the policy that installs our expert-parallel blocks."""
    placement = check_moe_model(config.parallel, config.moe, model.config, world_size)
    assert placement is not None  # ep > 1 here
    comm = MoeComm(log=config.moe.log_events, fit=config.moe.fit_gaps)
    policy = HeteroMixtralForCausalLMPolicy(comm, placement, packing=config.moe.packing)
    return MoeSetup(policy, comm, placement)


def gradient_groups(world_size: int, ep: int, tp: int = 1) -> tuple[ProcessGroup, ProcessGroup]:
    """(dense group, expert group) of this rank, new groups of their own.

    Colossal-AI's mesh ``(moe_dp, pp=1, ep, tp, sp=1)`` numbers rank ``(i * ep + e) * tp + t``
    for replica ``i`` of ep index ``e`` and tp index ``t``: the dense gradients of tp index
    ``t`` (a shard, or a copy of a replicated parameter) are reduced over every rank with that
    ``t``, the experts of index ``e`` over ``{(i * ep + e) * tp + t}``. Every rank creates
    every group, in the same order.
    """
    rank = dist.get_rank()
    replicas = world_size // (ep * tp)
    dense = mine = None
    for t in range(tp):
        group = dist.new_group([r for r in range(world_size) if r % tp == t])
        if rank % tp == t:
            dense = group
    for e in range(ep):
        for t in range(tp):
            group = dist.new_group([(i * ep + e) * tp + t for i in range(replicas)])
            if (rank // tp) % ep == e and rank % tp == t:
                mine = group
    assert dense is not None and mine is not None
    return dense, mine


def norm_groups(world_size: int, tp: int) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """(tp group, group of every rank) for the clipping norm (moe/clip.py), new groups of
    their own; (None, None) without tensor parallelism (the dense group is every rank)."""
    if tp == 1:
        return None, None
    rank = dist.get_rank()
    mine = None
    for start in range(0, world_size, tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= rank < start + tp:
            mine = group
    return mine, dist.new_group(list(range(world_size)))


def install_reducers(
    config: HeteroConfig, model: nn.Module, optimizer: Any, comm: MoeComm, dp_size: int
) -> dict[str, ChunkedGradReducer]:
    """Reducers for ``model`` (the booster's), attached to ``comm``; ``optimizer.step`` (the
    booster's, on the instance) flushes them first."""
    moe = config.moe
    blocks = [m for m in model.modules() if isinstance(m, HeteroEPMixtralSparseMoeBlock)]
    for block in blocks:  # read by each block's forward; auto: 1 until the chooser decides
        block.pipeline_chunks = 1 if moe.pipeline_auto else moe.pipeline_chunks
    if moe.pipeline_auto and moe.pipeline_chunks > 1:
        comm.chooser = PipelineChooser(blocks, moe.pipeline_chunks)
    expert_ids = {id(p) for block in blocks for p in block.expert_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    dense_params = [p for p in params if id(p) not in expert_ids]
    expert_params = [p for p in params if id(p) in expert_ids]
    world, tp = dist.get_world_size(), config.parallel.tp
    dense_group, expert_group = gradient_groups(world, config.parallel.ep, tp)
    _check_mesh(model, blocks, dense_group, expert_group)
    common: dict[str, Any] = {
        "max_inflight": moe.max_inflight,
        "priority": moe.priority,
        "divisor": dp_size,
    }
    profiles = profile_groups([dense_group, expert_group])  # collective, same on every rank
    reducers = {}
    for name, group, group_params, profile in zip(
        ("dense", "expert"),
        (dense_group, expert_group),
        (dense_params, expert_params),
        profiles,
        strict=True,
    ):
        alone = name == "dense" and dist.get_world_size(expert_group) == 1  # no expert traffic
        size = _group_chunk_bytes(moe, group_params, profile, alone)
        learn = name == "dense"  # experts: their layer is their phase, known up front
        reducers[name] = ChunkedGradReducer(
            group_params,
            group,
            chunk_bytes=size,
            learn_order=learn,
            phases=None if learn else expert_layers(blocks),
            **common,
        )
        reducers[name].set_profile(*profile)
        if moe.chunk_auto and not alone:  # judged by the chunks the phase runs make
            reducers[name].size_over_runs(*profile, MIN_CHUNK_BYTES)  # capped there
    syncing = _sync_flag(model)
    for reducer in reducers.values():
        reducer.syncing = syncing
    comm.attach(reducers)
    if optimizer is not None:
        if float(getattr(optimizer, "max_norm", 0.0) or 0.0) > 0:
            install_ep_grad_norm(optimizer, reducers, *norm_groups(world, tp))
        optimizer.step = flush_then_step(optimizer, optimizer.step, comm)
    return reducers


def _group_chunk_bytes(
    moe: Any, params: list[nn.Parameter], profile: tuple[float, float], alone: bool
) -> int:
    """A gradient group's chunk size: ``moe.chunk_bytes`` evened out; with ``chunk_auto`` the
    largest, for ``size_over_runs`` to choose below, or (the dense group without expert
    traffic, ``alone``) :func:`chosen_chunk_bytes` in at least ``MIN_CHUNKS`` chunks."""
    least = MIN_CHUNKS if alone else 1
    if moe.chunk_auto and not alone:
        return int(moe.chunk_bytes)
    if moe.chunk_auto:
        return chosen_chunk_bytes(params, profile, moe.chunk_bytes, least)
    return _evened(params, moe.chunk_bytes, least)


def expert_layers(blocks: list[Any]) -> Callable[[Sequence[nn.Parameter]], list[int]]:
    """The experts' gradient phases for :class:`ChunkedGradReducer`: a parameter's MoE layer
    (its block's index in ``blocks``), looked up when called, so that it also labels the
    parameters a re-placement (moe/replace.py) creates; -1 for any other parameter. Backward
    produces a layer's expert gradients between that layer's two backward a2a's."""

    def layers(params: Sequence[nn.Parameter]) -> list[int]:
        layer_of = {id(p): i for i, block in enumerate(blocks) for p in block.expert_parameters()}
        return [layer_of.get(id(p), -1) for p in params]

    return layers


def _check_mesh(
    model: nn.Module, blocks: list[Any], dense: ProcessGroup, expert: ProcessGroup
) -> None:
    """Our groups hold the ranks of Colossal-AI's own (the model's data-parallel group, the
    blocks' ``moe_dp_group``): a mesh numbered otherwise fails here, on every rank alike,
    instead of reducing the wrong gradients together. Local; no collective."""
    ranks = dist.get_process_group_ranks
    theirs = getattr(model, "dp_group", None)
    if theirs is not None and ranks(theirs) != ranks(dense):
        raise RuntimeError(f"dense gradient group {ranks(dense)} != dp group {ranks(theirs)}")
    for block in blocks:
        if block.moe_dp_group is not None and ranks(block.moe_dp_group) != ranks(expert):
            raise RuntimeError(
                f"expert gradient group {ranks(expert)} != moe_dp group {ranks(block.moe_dp_group)}"
            )


def _sync_flag(model: nn.Module) -> Callable[[], bool]:
    """The reducers' ``syncing``: Colossal-AI's ``require_grad_sync`` of the boosted model,
    which ``booster.no_sync(model, optimizer)`` (and ``model.no_sync()``) turn off."""

    def syncing() -> bool:
        return bool(getattr(model, "require_grad_sync", True))

    return syncing


def chosen_chunk_bytes(
    params: list[nn.Parameter], profile: tuple[float, float], most: int, min_count: int = 1
) -> int:
    """The chunk size of ``moe.chunk_auto`` for the gradient of ``params`` (local, no
    collective): :func:`.chunks.choose_chunk_bytes` over its bytes with the group's profile
    ``(alpha, beta)``, from :data:`MIN_CHUNK_BYTES` (or ``most``, if smaller) to ``most``;
    that size is already even (``ceil(total / count)``). Fewer than ``min_count`` chunks are
    cut finer by :func:`_evened`. ``most`` for a group without parameters."""
    if not params:
        return most
    dtypes = {p.dtype for p in params}
    itemsize = params[0].dtype.itemsize if len(dtypes) == 1 else 1  # mixed: chunks break
    total = sum(p.numel() * p.dtype.itemsize for p in params)
    size = choose_chunk_bytes(
        total, *profile, itemsize=itemsize, min_bytes=min(MIN_CHUNK_BYTES, most), max_bytes=most
    )
    if -(-total // size) >= min_count:
        return size
    return _evened(params, size, min_count)


def _evened(params: list[nn.Parameter], size: int, min_count: int = 1) -> int:
    """``size`` evened out over the gradient of ``params`` into at least ``min_count`` chunks,
    as far as each keeps :data:`MIN_CHUNK_BYTES` (:func:`.chunks.even_chunk_bytes`: no tail
    chunk much smaller than the others); unchanged for mixed dtypes (chunks break at each)."""
    if not params or len({p.dtype for p in params}) > 1:
        return size
    itemsize = params[0].dtype.itemsize
    total = sum(p.numel() for p in params) * itemsize
    count = min(min_count, max(1, total // MIN_CHUNK_BYTES))
    return even_chunk_bytes(total, size, itemsize, count)


class MoeStepLog:
    """Seam controller: a fresh event log per step, written per step when given a folder."""

    def __init__(
        self, comm: MoeComm, placement: Placement, folder: str | Path | None, rank: int
    ) -> None:
        self.comm, self.placement = comm, placement
        self.writer = DecisionWriter(folder, "moe", rank)
        self.last: list[tuple[str, str, int, float, float, int]] = []

    def on_step_begin(self, step: int) -> None:
        self.comm.clear()

    def on_step_end(self, step: int, timing: Any) -> None:
        self.last = self.comm.step_log()
        record: dict[str, Any] = {"step": step, "controller": "moe", "events": self.last}
        chooser = self.comm.chooser
        step_s = getattr(timing, "step_time", None)
        decided = chooser.on_step_end(step, self.last, step_s) if chooser else None
        if decided is not None:  # collective: every rank at the same step
            record["pipeline"] = decided
        if step == 0:
            record["placement"] = self.placement.record()
        if self.writer.path is not None:
            self.writer.write(record)

    def close(self) -> None:
        self.writer.close()
