"""balancer.mode resize under parallel.tp_mode 2d: the controller drives ZERO-resizing inside
the SUMMA steps (tp2d/resize.py's LayerOps2D, chosen by the plugin) in a plain Booster loop.

GPT-2 (tiny, widened) on a 2 x 2 mesh of 4 gloo ranks, SGD fp32. Rank 3 is emulated 4x slow
for steps 2-11; the interceptor's clock is CPU time plus the emulated sleeps
(tests/distributed/accounted_clock.py), so the detector reads the accounted slowdown whatever
the host's load. Checked on every rank:
- the agreed plan flags rank 3 alone, and its ops attach on every rank at the same step;
- while attached, rank 3's mesh position (and only it) computes a kept subset of every
  Linear2D's reduction dimension, the same subset on every rank, of the size the pure
  ``kept_fraction`` gives at the agreed slowdown (never a constant);
- an eval forward with ops attached equals the same forward with them detached (never active
  in eval), and every loss is finite;
- ``balancer.mode: migrate`` (no 2D op) and ``semi``: one ConfigError naming the field, on
  every rank, before any collective.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from colossalai.booster import Booster

from colossal_hetero.balance.ops.selection import kept_count
from colossal_hetero.config.loader import ConfigError
from colossal_hetero.config.schema import (
    BalancerConfig,
    ClusterConfig,
    EmulationConfig,
    HeteroConfig,
    ParallelConfig,
    PlanConfig,
    SlowdownSpec,
)
from colossal_hetero.models import build_model, loss_from_outputs
from colossal_hetero.plugin import HeteroParallelPlugin
from colossal_hetero.tp2d.resize import linear_layers
from tests.dist_utils import run_distributed
from tests.distributed.accounted_clock import account_in_cpu_time
from tests.tiny_models import GPT2 as TINY

GPT2 = replace(TINY, hf={**TINY.hf, "n_embd": 128, "n_inner": 512, "n_head": 4})
STEPS, SLOW_FROM, SLOW_UNTIL, EVERY, SLOW_RANK = 12, 2, 12, 2, 3


def _config(mode: str = "resize") -> HeteroConfig:
    return HeteroConfig(
        parallel=ParallelConfig(tp=4, tp_mode="2d"),
        cluster=ClusterConfig(device="cpu"),
        plan=PlanConfig(reference_tflops=0.01),
        emulation=EmulationConfig(
            compute=[
                SlowdownSpec(rank=SLOW_RANK, factor=4.0, start_step=SLOW_FROM, end_step=SLOW_UNTIL)
            ]
        ),
        balancer=BalancerConfig(
            mode=mode,  # type: ignore[arg-type]
            every=EVERY,
            window=EVERY,
            smoothing=1.0,
            threshold=0.5,  # the emulated 4x, far above CPU-time noise
            release=0.3,
            accuracy_budget=0.5,
            probe_steps=100,  # no probe inside this short run
        ),
    )


def _batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(step % 4))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _kept_sizes(model: Any) -> dict[str, dict[tuple[int, int], int]]:
    """Per Linear2D: the kept entry count per resized mesh position (empty when whole)."""
    out = {}
    for name, layer in linear_layers(model.unwrap()).items():
        op = layer.resize
        out[name] = {} if op is None else {p: int(k.numel()) for p, k in op.kept.items()}
    return out


def _eval_ignores_ops(model: Any, batch: dict) -> bool:
    layers = linear_layers(model.unwrap())
    model.eval()
    with torch.no_grad():
        with_ops = model(**batch).loss.clone()
        saved = {name: layer.resize for name, layer in layers.items()}
        for layer in layers.values():
            layer.resize = None
        without = model(**batch).loss
        for name, layer in layers.items():
            layer.resize = saved[name]
    model.train()
    return torch.equal(with_ops, without)


def _train() -> dict[str, Any]:
    plugin = HeteroParallelPlugin(_config(), workload=(8, 32))
    account_in_cpu_time(plugin.timer)
    out: dict[str, Any] = {"losses": [], "kept": [], "eval_same": []}
    try:
        torch.manual_seed(0)
        model = build_model(GPT2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer, criterion, _, _ = Booster(plugin=plugin).boost(
            model, optimizer, loss_from_outputs
        )
        for step in range(STEPS):
            batch = _batch(step)
            loss = criterion(model(**batch), batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out["losses"].append(float(loss))
            out["kept"].append(_kept_sizes(model))
            if any(out["kept"][-1].values()):
                out.setdefault("offload", plugin.balancer.plan.of(SLOW_RANK))
                out["eval_same"].append(_eval_ignores_ops(model, batch))
        out["controller"] = plugin.balancer
        out["mesh"], out["model"] = model.unwrap().mesh, model.unwrap()
        return out
    finally:
        plugin.close()


def _check_controller_drives_2d_resize(rank: int) -> None:
    run = _train()
    assert all(math.isfinite(x) for x in run["losses"])
    attached = [step for step, sizes in enumerate(run["kept"]) if any(sizes.values())]
    assert attached, "the 4x straggler was never resized"
    records = [r for r in run["controller"].log.records if r["decision"]["action"] == "in_layer"]
    assert records, [r["decision"] for r in run["controller"].log.records]
    slowdown = records[0]["inputs"]["slowdown"]
    assert max(range(4), key=lambda r: slowdown[r]) == SLOW_RANK
    assert slowdown[SLOW_RANK] > 2.0 and max(slowdown[:SLOW_RANK]) < 1.5
    offload = run["offload"]  # the plan attached at the first resized step
    assert offload is not None and offload.action == "resize"
    assert 0 < offload.dropped <= 0.5  # from the agreed slowdown, capped by accuracy_budget
    position = run["mesh"].layout.position(SLOW_RANK)
    sizes = run["kept"][attached[0]]
    agreed: list[Any] = [None] * 4
    dist.all_gather_object(agreed, sizes)
    assert all(other == sizes for other in agreed)  # the same subsets on every rank
    layers = linear_layers(run["model"])
    assert sizes.keys() == layers.keys()
    for name, by_position in sizes.items():
        assert set(by_position) == {position}, (name, by_position)  # the straggler alone
        width = sum(layers[name].in_sizes)
        assert by_position[position] == kept_count(width, 1 - offload.dropped) < width
    assert all(run["eval_same"])


def _check_bad_modes() -> None:
    for mode in ("migrate", "semi"):
        with pytest.raises(ConfigError, match=f"balancer.mode: {mode} is not available"):
            HeteroParallelPlugin(_config(mode), workload=(8, 32))


def _run(rank: int, world_size: int, device: torch.device) -> None:
    _check_bad_modes()
    dist.barrier()
    _check_controller_drives_2d_resize(rank)


def test_balancer_resize_drives_2d_zero_resizing() -> None:
    run_distributed(_run, 4, force_cpu=True)
