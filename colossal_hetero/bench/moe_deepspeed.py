"""The DeepSpeed-MoE baseline of ``bench moe`` (optional: ``pip install .[deepspeed]``).

The same Hugging Face Mixtral (sizes, initial weights, data) with each layer's sparse MoE
block replaced by ``deepspeed.moe.layer.MoE`` over the layer's own experts (Mixtral's expert
MLPs, copied), top-k as the model's, ``ep_size`` as ours; no token dropping
(``drop_tokens=False``: every token reaches its experts, as in ours and Colossal-AI's), no
random second-expert sampling, and the router's auxiliary loss DeepSpeed's own ``l_aux``
(weighted by the model's ``router_aux_loss_coef``). ``deepspeed.initialize`` with the CPU
accelerator (``DS_ACCELERATOR=cpu``), on the bench's already initialised gloo world, at the
bench's precision (bf16: DeepSpeed's bf16 optimizer), with the optimizer built from
``split_params_into_different_moe_groups_for_optimizer`` (expert gradients reduced over the
expert-data-parallel group, as DeepSpeed prescribes).

:func:`deepspeed_variant` returns the variant for ``bench.rounds`` (or None with the reason
when DeepSpeed is not installed), so ``bench moe`` interleaves it with the others.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colossal_hetero.utils.device import collective_device, deepspeed_accelerator_name

FIGURES = {"deepspeed": "all_on_vs_deepspeed", "deepspeed_ep4": "ep4_all_vs_deepspeed"}
"""The paired figure's name per variant name (``baseline_round_entries``)."""
MISSING = "DeepSpeed-MoE baseline not run: deepspeed is not installed (pip install .[deepspeed])"


def available() -> bool:
    """Whether deepspeed can be imported here (the optional extra)."""
    return importlib.util.find_spec("deepspeed") is not None


class _DeepSpeedBlock(nn.Module):
    """Mixtral's ``block_sparse_moe`` interface over ``deepspeed.moe.layer.MoE``: returns
    ``(hidden, router_logits)``; the aux loss is kept in ``l_aux`` for the training step."""

    def __init__(self, block: nn.Module, ep: int, top_k: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        hidden = block.gate.in_features
        experts = len(block.experts)
        self.moe = MoE(
            hidden,
            copy.deepcopy(block.experts[0]),
            num_experts=experts,
            ep_size=ep,
            k=top_k,
            drop_tokens=False,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        # DeepSpeed's gate and local experts start from the Mixtral weights (same model). Its
        # expert-parallel groups (made at initialize) are runs of ep consecutive ranks, and ep
        # rank r holds experts r * local ... (checked after initialize).
        self.ep_rank = dist.get_rank() % ep
        with torch.no_grad():
            self.moe.deepspeed_moe.gate.wg.weight.copy_(block.gate.weight)
            local = self.moe.deepspeed_moe.experts.deepspeed_experts
            first = self.ep_rank * len(local)
            for j, expert in enumerate(local):
                expert.load_state_dict(block.experts[first + j].state_dict())
        self.l_aux = torch.zeros(())

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        out, self.l_aux, _ = self.moe(hidden_states)
        return out, None


def _build(model: nn.Module, ep: int, precision: str, micro_batch: int) -> tuple[Any, list]:
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    with contextlib.redirect_stdout(io.StringIO()):  # adopts the bench's gloo world
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    model.config.output_router_logits = False  # the aux loss is DeepSpeed's l_aux
    blocks = []
    for layer in model.model.layers:
        block = _DeepSpeedBlock(layer.block_sparse_moe, ep, model.config.num_experts_per_tok)
        layer.block_sparse_moe = block
        blocks.append(block)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"}
    )
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    for block in blocks:
        if dist.get_rank(block.moe.deepspeed_moe.ep_group) != block.ep_rank:
            raise RuntimeError("DeepSpeed's expert-parallel layout is not the one assumed")
    return engine, blocks


def deepspeed_variant(
    make_model: Callable[[], nn.Module],
    ep: int,
    precision: str,
    micro_batch: int,
    batch: Callable[[int], torch.Tensor],
    agreed: Callable[[list[float]], list[float]],
    scope: Callable[[int], AbstractContextManager[dict[str, float]]] | None = None,
) -> tuple[Callable[..., dict[str, float]] | None, str | None, Any]:
    """``(variant, None, engine)`` for ``run_rounds``, or ``(None, reason, None)``.

    The variant trains one step on round ``index``'s batch and returns the slowest rank's
    step time (``step``); the time inside synchronous collectives is not split out
    (DeepSpeed issues its own). With ``scope``, forward, backward and step run inside
    ``scope(index)`` (``bench moe``: the emulated device's interceptor step), and what it
    yields (numbers) is returned too, agreed. Call on every rank (collective: DeepSpeed
    makes its groups).
    """
    if not available():
        return None, MISSING, None
    os.environ.setdefault("DS_ACCELERATOR", deepspeed_accelerator_name(collective_device()))
    notes = io.StringIO()  # DeepSpeed's groups and torch's GPU-toolkit probe print notes
    with contextlib.redirect_stdout(notes), contextlib.redirect_stderr(notes):
        engine, blocks = _build(make_model(), ep, precision, micro_batch)
    coef = float(engine.module.config.router_aux_loss_coef)

    def run(index: int, *, warmup: bool) -> dict[str, float]:
        ids = batch(index)
        dist.barrier()
        start = time.perf_counter()
        with scope(index) if scope is not None else contextlib.nullcontext({}) as seen:
            loss = engine(input_ids=ids, labels=ids).loss
            loss = loss + coef * sum(block.l_aux for block in blocks)
            engine.backward(loss)
            engine.step()
        elapsed = time.perf_counter() - start
        names = sorted(seen)
        step, *values = agreed([elapsed, *(seen[name] for name in names)])
        return {"step": step, **dict(zip(names, values, strict=True))}

    return run, None, engine


def held_loss(engine: Any, batch: Callable[[int], torch.Tensor], index: int) -> float:
    """The language-model loss of DeepSpeed's model on round ``index``'s batch (no step)."""
    with torch.no_grad():
        ids = batch(index)
        return float(engine(input_ids=ids, labels=ids).loss)


def baseline_round_entries(
    make_model: Callable[[], nn.Module],
    ep: int,
    precision: str,
    micro_batch: int,
    batch: Callable[[int], torch.Tensor],
    agreed: Callable[[list[float]], list[float]],
    all_on: str,
    scope: Callable[[int], AbstractContextManager[dict[str, float]]] | None = None,
    name: str = "deepspeed",
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``bench moe``'s registration: (variants, figures, info) to merge into its rounds.

    ``all_on`` names the everything-on variant; the figure (``FIGURES[name]``, e.g.
    ``all_on_vs_deepspeed``) is DeepSpeed's step over it, paired per round; the variant is
    called ``name``; ``scope`` as in ``deepspeed_variant``. Empty dicts and the reason when
    DeepSpeed is missing. Call on every rank.
    """
    run, reason, engine = deepspeed_variant(
        make_model, ep, precision, micro_batch, batch, agreed, scope
    )
    if run is None:
        return {}, {}, {"reason": reason}
    figure = FIGURES.get(name, f"all_on_vs_{name}")
    figures = {figure: lambda v: v[f"{name}.step"] / v[f"{all_on}.step"]}
    import deepspeed
    from deepspeed import comm as ds_comm

    backend = type(getattr(ds_comm.comm, "cdb", None)).__name__  # TorchBackend: torch.distributed
    info = {
        "version": deepspeed.__version__,
        "precision": precision,
        "comm_backend": backend,
        "engine": engine,
    }
    return {name: run}, figures, info
