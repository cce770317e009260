"""parallel.pp_schedule through the plugin, in a plain Booster loop on 2 gloo ranks (PP=2).

One spawn, four plugins one after another, each from the same initial model and batches:
1F1B (the default, even split) as the reference; kfkb with k=2 on a 1 + 3 layer split (and
``gc.every`` 2: no garbage collection inside a step, one at a step boundary), whose
losses and final parameters must equal 1F1B's bit for bit (each layer's arithmetic is the same
wherever it runs) (fp32; forwards and backwards run in increasing micro-batch order, so
every sum happens in the same order); ada_kfkb, which retunes k at its period, writes its
decision records and still matches 1F1B exactly; and a memory budget below one micro-batch,
refused with one ValueError on every rank after the first step.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from colossalai.booster import Booster
from colossalai.pipeline.schedule import OneForwardOneBackwardSchedule

from colossal_hetero.config import HeteroConfig, ParallelConfig
from colossal_hetero.config.collector import CollectorConfig
from colossal_hetero.config.schema import EmulationConfig, NetworkEmulationConfig
from colossal_hetero.models import build_model, loss_from_outputs
from colossal_hetero.pipeline.schedule import KFKBSchedule
from colossal_hetero.plugin import HeteroParallelPlugin
from tests.dist_utils import run_distributed
from tests.distributed.test_kfkb_schedule import GPT2, _batch

M = 4  # micro-batches per step, of 2 samples each
STEPS = 3
MESSAGE_BYTES = 2 * 16 * 32 * 4  # one activation message: [2, 16, 32] fp32 hidden states
# A modelled link that takes 0.2 s per activation message (emulation model mode): the link
# sets the pace, and the tuner's 1F1B and k=2 (about 1.5 s predicted) beat k=4 (about 1.9 s) by
# far more than any compute jitter of milliseconds on a busy machine.
LINK_S = 0.2
SLOW_GBPS = MESSAGE_BYTES * 8 / LINK_S / 1e9


def _train(
    config: HeteroConfig,
    steps: int,
    metrics_dir: Path | None = None,
    on_plugin: Callable[[HeteroParallelPlugin], None] = lambda plugin: None,
):
    """A plain Booster loop; returns (plugin, last-stage losses, final parameters). The caller
    closes the plugin."""
    plugin = HeteroParallelPlugin(config, metrics_dir=metrics_dir)
    on_plugin(plugin)
    torch.manual_seed(0)
    model = build_model(GPT2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    booster = Booster(plugin=plugin)
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, loss_from_outputs)
    losses = []
    for step in range(steps):
        batch = _batch(2 * M, seed=100 + step)
        result = booster.execute_pipeline(iter([batch]), model, criterion, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        if result["loss"] is not None:
            losses.append(result["loss"].clone())
    params = {n: p.detach().clone() for n, p in model.unwrap().named_parameters()}
    return plugin, losses, params


def _assert_equal_run(got, want, what: str, same_split: bool = True) -> None:
    """Losses and this rank's parameters equal bit for bit. Under another stage split only the
    parameters both runs hold here are compared; the later losses depend on all of them."""
    losses, params = got
    assert len(losses) == len(want[0]) and all(map(torch.equal, losses, want[0])), what
    common = params.keys() & want[1].keys()
    assert common and (not same_split or params.keys() == want[1].keys()), what
    for name in common:
        assert torch.equal(params[name], want[1][name]), f"{what}: parameter {name} differs"


def _check_ada_records(plugin: HeteroParallelPlugin, rank: int, folder: Path) -> None:
    control = plugin.pipeline_control
    assert control is not None and control.log is not None
    records = control.log.records
    assert [r["step"] for r in records] == [1]  # period 2 over 3 steps: after step 1 only
    record = records[0]
    # The first retuning takes the fastest prediction (start_free): k = 1 or 2 (within ~2% of
    # each other here, so which one follows the measured compute), far ahead of the start 4.
    by_k = {int(k): t for k, t in record["predicted_s_by_k"].items()}
    chosen = record["decision"]["k"]
    assert chosen == min(by_k, key=lambda k: (by_k[k], k)) and chosen < 4, record
    assert record["decision"]["previous_k"] == 4 and by_k[chosen] < 0.9 * by_k[4], record
    schedule = plugin.engine.scheduler
    assert schedule.k == chosen
    inputs = record["inputs"]
    assert all(t > 0 for t in (*inputs["forward_s"], *inputs["backward_s"]))  # measured
    # The link time measured from both ends' timestamps is the modelled one: later by sleep
    # overshoot and scheduling, never much earlier.
    assert 0.9 * LINK_S <= inputs["transfer_s"][0] <= 1.5 * LINK_S, inputs
    assert inputs["activation_bytes"][rank] >= schedule.last_stats.activation_bytes
    seen = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(seen, torch.tensor([float(schedule.k)]))
    assert [int(x) for x in seen] == [chosen, chosen]
    lines = (folder / f"pipeline_rank{rank}.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == records


def _two_ranks(rank, world_size, device, folder: str):
    base = ParallelConfig(pp=2, num_microbatches=M)
    plugin, *reference = _train(HeteroConfig(parallel=base), STEPS)
    assert type(plugin.engine.scheduler) is OneForwardOneBackwardSchedule
    assert plugin.pipeline_control is None
    plugin.close()
    assert len(reference[0]) == (STEPS if rank == 1 else 0)

    # kfkb with an uneven stage split: stage 0 holds block 0, stage 1 blocks 1-3.
    kfkb = ParallelConfig(
        pp=2, num_microbatches=M, pp_schedule="kfkb", pp_k=2, num_layers_per_stage=[1, 3]
    )
    # ... with gc.every 2: no garbage collection inside a step, one after step 1 (of 0-2)
    inside: list[int] = []
    holder: list[HeteroParallelPlugin] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "stop" and holder and holder[0].seam.open_step is not None:
            inside.append(info["generation"])

    gc.callbacks.append(watch)
    try:
        config = HeteroConfig(parallel=kfkb, gc=CollectorConfig(every=2))
        plugin, *got = _train(config, STEPS, on_plugin=holder.append)
    finally:
        gc.callbacks.remove(watch)
    assert inside == [] and plugin.collector.collections == 1 and not gc.isenabled()
    schedule = plugin.engine.scheduler
    assert isinstance(schedule, KFKBSchedule) and schedule.k == 2
    assert schedule.peak_saved == min(2 * (2 - rank), M)  # it really ran groups of 2
    blocks = {n.split(".")[2] for n in got[1] if n.startswith("transformer.h.")}
    assert blocks == ({"0"} if rank == 0 else {"1", "2", "3"}), blocks
    assert plugin.pipeline_control is None
    plugin.close()
    assert gc.isenabled()  # restored as the plugin found it
    _assert_equal_run(got, reference, f"kfkb k=2 split [1, 3] rank {rank}", same_split=False)

    ada = ParallelConfig(
        pp=2, num_microbatches=M, pp_schedule="ada_kfkb", pp_k=4, pp_retune_every=2
    )
    slow = EmulationConfig(network=NetworkEmulationConfig(bandwidth_gbps=SLOW_GBPS))
    config = HeteroConfig(parallel=ada, emulation=slow)
    plugin, *got = _train(config, STEPS, Path(folder))
    try:
        _check_ada_records(plugin, rank, Path(folder))
    finally:
        plugin.close()
    _assert_equal_run(got, reference, f"ada_kfkb rank {rank}")  # k went 4, 4, then 1 or 2

    tiny = ParallelConfig(
        pp=2, num_microbatches=M, pp_schedule="ada_kfkb", pp_memory_budget_mib=1e-6
    )
    with pytest.raises(ValueError, match=r"^parallel\.pp_memory_budget_mib: .* below one micro"):
        _train(HeteroConfig(parallel=tiny), 1)


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_pp_schedule_through_the_plugin(tmp_path):
    run_distributed(_two_ranks, world_size=2, folder=str(tmp_path))
