"""Shaped mode on real links: rates, contention, preemption, cleanup, and training parity.

Each test builds its own namespaces (``chs-<hex>-``), sends traffic only between them, and
checks that nothing of its run remains. They need root and iproute2; CI runs as root.

Timing margins: the links run at 200 Mbit/s, so a 2 MiB transfer takes 84 ms on the wire, far
above per-call overheads (a few ms on a loaded 2-core machine); every assertion compares a
median of several repeats against the rate or against another median of the same launch.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from colossal_hetero.bench.network import phases, predictions, run_shaped_phase, run_shaped_repeats
from colossal_hetero.bench.shaped_spawn import run_bench_ranks
from colossal_hetero.cli import launch_command
from colossal_hetero.config import ConfigError
from colossal_hetero.config.schema import NetworkEmulationConfig
from colossal_hetero.emulation.shaped.netns import list_namespaces, probe_netem
from colossal_hetero.emulation.shaped.topology import new_prefix
from colossal_hetero.metrics import read_run


def _shaped_unavailable() -> str:
    if os.geteuid() != 0:
        return "shaped mode needs root (network namespaces, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "shaped mode needs iproute2 (ip, tc)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True)
    return "" if probe.returncode == 0 else "`ip netns` is unavailable here"


pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(bool(_shaped_unavailable()), reason=_shaped_unavailable() or "-"),
]

RATE_TOLERANCE = 0.15  # the issue's bound; measured 2-6% (TCP/IP headers are ~3-4% of a packet)


def test_rates_and_all_to_all_behind_all_reduce():
    # 2 ranks, 7 repeats of every pattern. The rate is checked on each pattern's fastest
    # repeat: a shaped link cannot carry the bytes faster than its rate, so the fastest repeat
    # sits at the rate when the shaping is right and below it when it is missing. Single
    # repeats run about 2x slow, most likely when gloo's rendezvous notice queues behind the
    # other direction's bulk data and the two directions serialise (docs/cpu-and-emulation.md);
    # in one idle CI run at least 4 of 7 all-to-all repeats did, so even the median can be 2x.
    phase = replace(phases(quick=True)[0], repeats=7)
    repeats, leftovers = run_shaped_repeats(phase)
    shaped = {name: statistics.median(times) for name, times in repeats.items()}
    predicted = predictions(phase)
    for name in ("allreduce", "p2p", "alltoall"):
        fastest = min(repeats[name])
        error = abs(fastest - predicted[name]) / predicted[name]
        assert error <= RATE_TOLERANCE, (name, sorted(repeats[name]), predicted[name])
    # Queued behind the large all-reduce's data, the small all-to-all waits: the env notes
    # measured 11x (57 ms vs 5 ms); this bed gives about 6-8x; the issue asks for > 3.
    ratio = shaped["small_alltoall_behind"] / shaped["small_alltoall_alone"]
    assert ratio > 3, (shaped["small_alltoall_behind"], shaped["small_alltoall_alone"])
    assert leftovers == 0


def test_rate_change_and_tenant_slow_only_the_targeted_rank():
    phase = phases(quick=True)[1]  # 3 ranks; preempt rank 2 at step 1 (rate), step 2 (tenant)
    shaped, leftovers = run_shaped_phase(phase)
    # p2p 0 -> 2 (targeted) and 0 -> 1 (untouched) at each step, the same 2 MiB.
    rate_target = shaped["rate_change_target"] / shaped["before_target"]
    rate_other = shaped["rate_change_other"] / shaped["before_other"]
    tenant_target = shaped["tenant_target"] / shaped["before_target"]
    tenant_other = shaped["tenant_other"] / shaped["before_other"]
    assert 1.7 < rate_target < 2.3, rate_target  # factor 0.5 halves the rate: 2x (measured 2.0)
    assert tenant_target > 1.3, tenant_target  # TCP competition at a 50% share (measured 1.6)
    for untouched in (rate_other, tenant_other):
        assert untouched < 1.15, untouched  # same link rate: only noise (measured 1.00-1.03)
    assert leftovers == 0


def timed_p2p_worker(*, rank: int, world_size: int, device: object, mib: float) -> dict:
    """A bench worker for ``run_bench_ranks``: which links it ran on and a timed p2p 0 -> 1."""
    import torch
    import torch.distributed as dist

    from colossal_hetero.bench.shaped_spawn import on_shaped_links

    buffer = torch.ones(int(mib * (1 << 20)) // 4)
    times = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buffer, 1)
        else:
            dist.recv(buffer, 0)
        times.append(time.perf_counter() - start)
    return {"shaped": on_shaped_links(), "seconds": sorted(times)[1], "world": world_size}


@pytest.mark.slow  # ~30-50 s; the default run covers the helper's shaped path through
# test_rates_and_all_to_all_behind_all_reduce (bench network launches via run_shaped_ranks)
def test_bench_helper_runs_a_worker_on_shaped_links():
    network = NetworkEmulationConfig(mode="shaped", bandwidth_gbps=0.2)
    results = run_bench_ranks(timed_p2p_worker, 2, network=network, timeout_s=120, mib=2.0)
    assert [r["shaped"] for r in results] == [True, True]
    assert [r["world"] for r in results] == [2, 2]
    predicted = 2.0 * (1 << 20) * 8 / 0.2e9  # 84 ms at 200 Mbit/s
    received = results[1]["seconds"]  # the receiver's clock: recv returns on arrival
    assert abs(received - predicted) / predicted <= RATE_TOLERANCE, (received, predicted)
    # run_bench_ranks raises if the run's own namespaces (its prefix) outlive it.


def ping_pong_worker(*, rank: int, world_size: int, device: object) -> float:
    """Median round trip of a 4-byte message 0 -> 1 -> 0 (rank 0's clock)."""
    import torch
    import torch.distributed as dist

    token, trips = torch.zeros(1), []
    for _ in range(7):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(token, 1)
            dist.recv(token, 1)
        else:
            dist.recv(token, 0)
            dist.send(token, 0)
        trips.append(time.perf_counter() - start)
    return sorted(trips)[3]


def _netem_missing() -> str:
    return "" if probe_netem() else "this kernel has no netem qdisc (sch_netem)"


def test_latency_without_netem_is_one_error_naming_the_field():
    if not _netem_missing():
        pytest.skip("this kernel has netem: the latency path runs instead")
    before = set(list_namespaces())
    network = NetworkEmulationConfig(mode="shaped", bandwidth_gbps=0.2, latency_us=5000)
    with pytest.raises(ConfigError, match=r"^emulation.network.latency_us: .*mode: model"):
        run_bench_ranks(ping_pong_worker, 2, network=network, timeout_s=60)
    assert set(list_namespaces()) <= before  # the probe's namespace is gone, nothing was built


def test_latency_on_shaped_links_delays_each_direction():
    missing = _netem_missing()
    if missing:
        pytest.skip(f"{missing}: shaped latency needs it (model mode models latency)")
    network = NetworkEmulationConfig(mode="shaped", bandwidth_gbps=0.2, latency_us=5000)
    rtt = run_bench_ranks(ping_pong_worker, 2, network=network, timeout_s=120)[0]
    # 5 ms one way, each direction (data on the sender's upload): a round trip of 10 ms plus
    # per-call overheads (a few ms on a loaded machine).
    assert 0.010 <= rtt <= 0.020, rtt


_SLEEPER = (
    "import os, pathlib, time\n"
    "folder = pathlib.Path(os.environ['PID_DIR'])\n"
    "(folder / f\"pid{os.environ['RANK']}\").write_text(str(os.getpid()))\n"
    "time.sleep(120)\n"
)


def _start_launcher(prefix: str, folder: Path, *extra: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "colossal_hetero.emulation.shaped", "--world", "2"]
    command += ["--bandwidth-gbps", "0.2", "--prefix", prefix, *extra]
    command += ["--", sys.executable, "-c", _SLEEPER]
    env = {**os.environ, "PID_DIR": str(folder)}
    return subprocess.Popen(command, env=env, stderr=subprocess.PIPE)


def _rank_pids(folder: Path, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [folder / f"pid{r}" for r in range(2)]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.1)
    raise AssertionError("the ranks never started")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def _assert_nothing_left(prefix: str, pids: list[int]) -> None:
    assert list_namespaces(prefix) == []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert prefix not in links and "chs0" not in links  # no veth end reached the host
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.parametrize("how", ["sigkill_rank", "sigint_launcher", "timeout"])
def test_cleanup_after_crash_interrupt_and_timeout(tmp_path, how):
    prefix = new_prefix()
    extra = ("--timeout", "3") if how == "timeout" else ()
    launcher = _start_launcher(prefix, tmp_path, *extra)
    try:
        pids = _rank_pids(tmp_path)
        assert len(list_namespaces(prefix)) == 3  # switch + 2 ranks exist while running
        if how == "sigkill_rank":
            os.kill(pids[1], signal.SIGKILL)
        elif how == "sigint_launcher":
            launcher.send_signal(signal.SIGINT)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    expected = {"sigkill_rank": 137, "sigint_launcher": 130, "timeout": 124}[how]
    assert launcher.returncode == expected, stderr.decode()
    if how == "sigkill_rank":
        assert b"rank 1 exited with code 137" in stderr
    _assert_nothing_left(prefix, pids)


TINY_GPT2_TP2 = {
    "model": {
        "arch": "gpt2",
        "hf": {"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 32},
    },
    "data": {"dataset": "pydoc_topics", "seq_len": 32, "global_batch_size": 4},
    "parallel": {"tp": 2},
    "cluster": {"device": "cpu"},
    "optimizer": {"name": "adamw", "lr": 0.01},
    "train": {"steps": 3, "eval_every": 0},
    "logging": {"progress": False, "plot": False},
}


def _train(config: dict, folder: Path, mode: str | None) -> list[float]:
    """Losses of rank 0; ``mode``: None (no emulation), ``model`` or ``shaped`` at 0.2 Gbit/s."""
    folder.mkdir()
    config = {**config, "logging": {**config["logging"], "dir": str(folder / "run")}}
    if mode is not None:
        config["emulation"] = {"network": {"mode": mode, "bandwidth_gbps": 0.2}}
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if mode == "shaped":
        command = [sys.executable, "-m", "colossal_hetero.cli", "train", str(path)]
    else:
        command = launch_command(path, 2)
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return [r.loss for r in read_run(folder / "run") if r.rank == 0]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gpt2_tp2_training_under_shaped_links_matches_no_emulation(tmp_path):
    plain = _train(TINY_GPT2_TP2, tmp_path / "plain", None)
    model = _train(TINY_GPT2_TP2, tmp_path / "model", "model")
    before = set(list_namespaces())
    shaped = _train(TINY_GPT2_TP2, tmp_path / "shaped", "shaped")
    assert len(plain) == 3 and all(isinstance(loss, float) for loss in plain)
    # Shaping (or modelling) the links changes when bytes arrive, never which: the same gloo
    # collectives in the same order give bitwise equal losses.
    assert shaped == plain and model == plain
    assert set(list_namespaces()) <= before
