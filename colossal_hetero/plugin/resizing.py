"""Resize a boosted model's tensor-parallel shards between steps: the plugin's ``resize``.

layers/resize.py moves every sharded tensor (weights, gradients, mixed-precision fp32 master
copies, optimizer state) within each TP group. This module does what the boosted model around
those layers needs:

- **Agreement first.** Every rank must ask for the same widths: each data-parallel replica's
  TP group resizes identically, so the replicas stay copies of one another. A checksum of the
  resolved widths is compared over the whole world (one all-reduce of two integers) before any
  data moves; a mismatch, or widths that do not fit the model, raise ``ValueError`` on every
  rank.
- **torch DDP (dp > 1).** DDP's reducer sizes its buckets at wrap time and keeps every
  parameter's gradient accumulator alive, whose recorded shape then rejects the resized
  gradients. After the move the reducer is released and the DDP is rebuilt around the same
  module with the same process group and options (Colossal-AI's ``ddp_config``).

ZeRO keeps flat fp32 partitions of the parameters over the data-parallel group, laid out at
wrap time; resizing them is not supported (``ValueError`` naming ``parallel.zero_stage``).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from colossal_hetero.policies import ResizablePolicy


def resize_boosted(
    model: Any,
    optimizer: Any,
    policy: ResizablePolicy,
    widths: Mapping[str, Sequence[int]],
    *,
    zero_stage: int,
    ddp_options: Mapping[str, Any],
    group: ProcessGroup,
    device: torch.device,
) -> None:
    """Move a boosted model (and its optimizer) to new per-rank ``widths``, losslessly.

    Args:
        model: the booster's model (Colossal-AI ``HybridParallelModule``) sharded by ``policy``.
        optimizer: the booster's optimizer, whose state (and fp32 master weights under mixed
            precision) moves too; may be None only without mixed precision.
        policy: the resizable policy the model was sharded with.
        widths: per key (``heads``, ``ffn``, ``vocab``) one count per TP rank; missing keys
            are split evenly. Must be the same on every rank of ``group``.
        zero_stage: the layout's ZeRO stage; must be 0.
        ddp_options: the keyword arguments the model's DDP was built with.
        group: every rank that calls this (the world for the plugin).
        device: where ``group``'s collectives take tensors.

    Collectives, in order: one all-reduce over ``group`` (widths agree); nothing more when the
    widths are the current ones. Else, over each TP group, per resized parameter one small
    all-reduce and one all-gather per moving tensor (layers/resize.py); then, when the model
    holds a DDP, DDP's construction over its data-parallel group (a shape check, and a
    broadcast of parameters and buffers from the group's first rank, which holds the same
    values already).

    Raises:
        ValueError: ZeRO, a model or optimizer that does not fit, or widths that differ across
            ranks or do not fit the model. The local checks raise before any collective, and
            the widths check on every rank together.
    """
    check_resizable(model, optimizer, policy, zero_stage=zero_stage)
    new = agreed_widths(policy, widths, group=group, device=device)
    if new == policy.widths:
        return
    policy.resize(new, optimizer=optimizer)
    rebuild_ddp(model, ddp_options)


def check_resizable(
    model: Any, optimizer: Any, policy: ResizablePolicy, *, zero_stage: int
) -> None:
    """ValueError unless ``model`` and ``optimizer`` can be resized; local, no collective."""
    if zero_stage > 0:
        raise ValueError(
            f"resize does not support ZeRO (parallel.zero_stage {zero_stage}): its flat fp32 "
            "partitions are laid out at wrap time; use parallel.zero_stage 0"
        )
    unwrap = getattr(model, "unwrap", None)
    if unwrap is None or unwrap() is not policy.model:
        raise ValueError("resize needs the model the plugin boosted (booster.boost's model)")
    if model.mixed_precision is not None and not hasattr(optimizer, "working_to_master_map"):
        raise ValueError(
            "resize under mixed precision needs the booster's optimizer: its fp32 master "
            "weights and their state must move with the working weights"
        )


def agreed_widths(
    policy: ResizablePolicy,
    widths: Mapping[str, Sequence[int]],
    *,
    group: ProcessGroup,
    device: torch.device,
) -> dict[str, tuple[int, ...]]:
    """``widths`` resolved against the model, checked equal on every rank of ``group``.

    One all-reduce (MAX) of a checksum and its negation over ``group``: every rank joins it,
    also when its widths do not fit the model, so that all ranks raise together.

    Raises:
        ValueError: the widths do not fit the model (raised with that message) or differ
            between ranks (raised on every rank whose own widths fit).
    """
    try:
        resolved, error = policy.resolve(widths), None
    except ValueError as exc:
        resolved, error = None, exc
    canonical = sorted(resolved.items()) if resolved is not None else str(error)
    digest = zlib.crc32(repr(canonical).encode())
    seen = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    assert resolved is not None
    if int(seen[0]) != digest or int(seen[1]) != -digest:
        raise ValueError(
            f"resize widths differ across ranks ({resolved} here): every rank, in every "
            "data-parallel replica and pipeline stage, must pass the same widths"
        )
    return resolved


def rebuild_ddp(model: Any, options: Mapping[str, Any]) -> None:
    """Re-wrap the torch DDP inside ``model`` (if any) for its parameters' current shapes.

    The old reducer (and the logger that refers to it) is released first: it holds every
    parameter's gradient accumulator, whose recorded shape would reject resized gradients.
    The new DDP wraps the same module with the same process group and ``options``; parameters
    excluded from DDP on the module (``_ddp_params_and_buffers_to_ignore``) stay excluded.
    Communication hooks registered on the old DDP are not carried over.
    """
    ddp = model.module
    if not isinstance(ddp, DistributedDataParallel):
        return
    del ddp.reducer
    ddp.logger = None
    model.module = DistributedDataParallel(
        ddp.module, process_group=ddp.process_group, **dict(options)
    )
