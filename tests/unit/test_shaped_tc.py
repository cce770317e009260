"""Shaped mode's pure parts: link rates per direction, tc and ip command lines, the launch
environment, preemption schedules, the controller's decisions and the capability checks.

References are hand-computed values (200 Mbit/s = 200000000 bit, one per direction)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
import yaml

from colossal_hetero.config import ConfigError, from_dict
from colossal_hetero.config.schema import (
    EmulationConfig,
    LinkSpec,
    NetworkEmulationConfig,
    PreemptionSpec,
    RunConfig,
)
from colossal_hetero.emulation import build_interceptor
from colossal_hetero.emulation.shaped.controller import (
    Controller,
    StepReporter,
    job_step,
    report_step,
)
from colossal_hetero.emulation.shaped.launcher import (
    check_shaped_device,
    rank_command,
    rank_env,
    run_shaped,
)
from colossal_hetero.emulation.shaped.netns import (
    check_netem_support,
    check_shaped_support,
    latency_field,
    setup_commands,
)
from colossal_hetero.emulation.shaped.tc import (
    change_commands,
    queue_bytes,
    rank_shape_commands,
    shape_commands,
)
from colossal_hetero.emulation.shaped.tenant import push
from colossal_hetero.emulation.shaped.topology import (
    SHAPED_ENV,
    Topology,
    rank_directions,
    rate_factors,
    tenant_shares,
    tenant_targets,
)

NET = NetworkEmulationConfig(
    mode="shaped",
    bandwidth_gbps=0.2,
    links=[LinkSpec(ranks=[0, 2], bandwidth_gbps=1.0, reverse_bandwidth_gbps=0.5, latency_us=100)],
)
TOPO = Topology("chs-abc123-", 3, tenant=True)


def test_directions_per_pair_and_asymmetric():
    dirs = rank_directions(NET, 3)
    up0, down0 = dirs[0]
    up2, down2 = dirs[2]
    assert (up0.default_bps, up0.default_latency, down0.default_latency) == (2e8, 0.0, 0.0)
    assert up0.peers == {2: (1e9, 100e-6)}  # 0 -> 2 at bandwidth_gbps, latency on the sender
    assert down2.peers == {0: (1e9, 0.0)}  # ... and the same rate into 2, no second latency
    assert up2.peers == {0: (0.5e9, 100e-6)}  # 2 -> 0 at reverse_bandwidth_gbps
    assert down0.peers == {2: (0.5e9, 0.0)}
    assert dirs[1][0].peers == {} and dirs[1][1].peers == {}


def test_shape_commands_htb_classes_filters_and_leaves():
    up0 = rank_directions(NET, 3)[0][0]
    cmds = [" ".join(c) for c in shape_commands("ns0", "chs0", up0, match="dst")]
    assert cmds[0] == "tc -n ns0 qdisc add dev chs0 root handle 1: htb default 1"
    assert "classid 1:1 htb rate 200000000bit ceil 200000000bit" in cmds[1]
    assert cmds[2].endswith(f"handle 200: bfifo limit {queue_bytes(2e8)}")
    assert queue_bytes(2e8) == 500000  # 20 ms at 25 MB/s
    assert any("classid 1:2 " in c for c in cmds) and any("flowid 1:2" in c for c in cmds)
    peer = [c for c in cmds if "1:102" in c]  # peer 2's class, hex 0x100 + 2
    assert "rate 1000000000bit" in peer[0]
    assert "match ip dst 10.213.0.3/32 flowid 1:102" in peer[1]
    # netem's packet limit: 100 us at 1 Gbit/s (12500 B) + the 20 ms queue (2.5 MB), in 9000 B
    # packets: ceil(2512500 / 9000) = 280.
    assert peer[2].endswith("handle 203: netem delay 100us limit 280")
    down = shape_commands("sw", "p2", rank_directions(NET, 3)[2][1], match="src", factor=0.5)
    assert "match ip src 10.213.0.1/32" in " ".join(down[-2])
    assert "rate 500000000bit" in " ".join(down[-3])  # 1 Gbit/s class at factor 0.5


def test_latency_gets_netem_on_data_and_ack_classes():
    # Default latency 50 us on every link, peer 2 at 100 us: data classes and ACKs delayed.
    net = NetworkEmulationConfig(
        mode="shaped",
        bandwidth_gbps=0.2,
        latency_us=50,
        links=[LinkSpec(ranks=[0, 2], bandwidth_gbps=1.0, latency_us=100)],
    )
    up0 = rank_directions(net, 3)[0][0]
    cmds = [" ".join(c) for c in shape_commands("ns0", "chs0", up0, match="dst")]
    # default data class: ceil((25e6 * 50e-6 + 500000) / 9000) = ceil(501250 / 9000) = 56
    assert "parent 1:1 handle 200: netem delay 50us limit 56" in cmds[2]
    ack_default = [c for c in cmds if "parent 1:2 " in c and "qdisc" in c]
    assert ack_default == [
        "tc -n ns0 qdisc add dev chs0 parent 1:2 handle 3ff: netem delay 50us limit 10000"
    ]
    # peer 2's ACKs: own class 1:302, filtered at prio 1 (before the generic ACK filter at 2)
    peer_ack = [c for c in cmds if "1:302" in c]
    assert "class add dev chs0 parent 1: classid 1:302 htb" in peer_ack[0]
    assert " prio 1 u32 " in peer_ack[1] and peer_ack[1].endswith(
        "match ip dst 10.213.0.3/32 flowid 1:302"
    )
    assert peer_ack[2].endswith("handle 402: netem delay 100us limit 10000")
    assert any(" prio 2 u32 " in c and c.endswith("flowid 1:2") for c in cmds)
    assert any(" prio 3 u32 match ip dst 10.213.0.3/32 flowid 1:102" in c for c in cmds)
    # A download (switch port) carries no latency: latency is added once, on the sender.
    down2 = rank_directions(net, 3)[2][1]
    assert not any("netem" in " ".join(c) for c in shape_commands("sw", "p2", down2, match="src"))
    # Without latency: no netem anywhere, bfifo leaves, one generic ACK class.
    plain = [
        " ".join(c)
        for c in shape_commands(
            "ns0",
            "chs0",
            rank_directions(NetworkEmulationConfig(mode="shaped", bandwidth_gbps=0.2), 3)[0][0],
            match="dst",
        )
    ]
    assert not any("netem" in c for c in plain) and sum("classid" in c for c in plain) == 2


def test_latency_needs_netem_checked_by_a_probe_first():
    calls = []

    def probe(found: bool):
        def run() -> bool:
            calls.append(found)
            return found

        return run

    plain = NetworkEmulationConfig(mode="shaped", bandwidth_gbps=0.2)
    assert latency_field(plain) is None
    check_netem_support(plain, probe(False))
    assert calls == []  # no latency asked: no probe (no namespace made)
    assert latency_field(NET) == "emulation.network.links[0].latency_us"
    with pytest.raises(ConfigError, match=r"^emulation.network.links\[0\].latency_us: .*netem"):
        check_netem_support(NET, probe(False))
    check_netem_support(NET, probe(True))
    default = NetworkEmulationConfig(mode="shaped", bandwidth_gbps=0.2, latency_us=20)
    assert latency_field(default) == "emulation.network.latency_us"
    with pytest.raises(ConfigError, match="mode: model"):
        check_netem_support(default, probe(False))
    assert calls == [False, True, False]
    # The launcher checks before it creates anything (no namespace, no process).
    made = []
    with pytest.raises(ConfigError, match="latency_us"):
        run_shaped(
            default, 2, ["true"], check=lambda: None, netem_probe=lambda: made.append(1) or False
        )
    assert made == [1]


def test_change_commands_scale_every_class():
    up0 = rank_directions(NET, 3)[0][0]
    cmds = [" ".join(c) for c in change_commands("ns0", "chs0", up0, 0.25)]
    assert len(cmds) == 2 and all(" class change " in c for c in cmds)
    assert "rate 50000000bit" in cmds[0] and "rate 250000000bit" in cmds[1]


def test_rank_shape_commands_cover_both_directions():
    up, down = rank_directions(NET, 3)[1]
    cmds = rank_shape_commands(TOPO, 1, up, down)
    devices = {(c[2], c[c.index("dev") + 1]) for c in cmds}
    assert devices == {("chs-abc123-r1", "chs0"), ("chs-abc123-sw", "p1")}


def test_setup_stays_inside_the_runs_namespaces():
    cmds = setup_commands(TOPO)
    created = [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    assert (
        created
        == TOPO.namespaces()
        == [
            "chs-abc123-sw",
            "chs-abc123-r0",
            "chs-abc123-r1",
            "chs-abc123-r2",
            "chs-abc123-tn",
        ]
    )
    for c in cmds[len(created) :]:
        assert c[1] == "-n" and c[2] in created, c  # never the host's namespace
    veths = [c for c in cmds if "veth" in c]
    assert len(veths) == 4 and all(c.count("9000") == 2 for c in veths)  # jumbo frames, both ends
    addresses = [c[5] for c in cmds if "addr" in c]
    assert addresses == ["10.213.0.1/24", "10.213.0.2/24", "10.213.0.3/24", "10.213.0.250/24"]


def test_rank_command_sets_torchruns_environment():
    cmd = rank_command(TOPO, 2, "/tmp/run", ["python", "-m", "x"])
    assert cmd[:5] == ["ip", "netns", "exec", "chs-abc123-r2", "env"]
    assert cmd[-3:] == ["python", "-m", "x"]
    env = rank_env(TOPO, 2, "/tmp/run")
    for key, value in {
        "RANK": "2",
        "LOCAL_RANK": "2",
        "WORLD_SIZE": "3",
        "LOCAL_WORLD_SIZE": "3",
        "MASTER_ADDR": "10.213.0.1",
        "MASTER_PORT": "29500",
        "GLOO_SOCKET_IFNAME": "chs0",
        SHAPED_ENV: "chs-abc123-",
    }.items():
        assert env[key] == value and f"{key}={value}" in cmd


def test_preemption_schedules():
    specs = [
        PreemptionSpec(factor=0.5, start_step=1, end_step=3, ranks=[2]),
        PreemptionSpec(factor=0.5, start_step=2, end_step=4),
        PreemptionSpec(factor=0.25, start_step=2, ranks=[1], kind="tenant"),
        PreemptionSpec(factor=0.5, start_step=3, ranks=[1], kind="tenant"),
    ]
    assert rate_factors(specs, 0, 3) == (1.0, 1.0, 1.0)
    assert rate_factors(specs, 1, 3) == (1.0, 1.0, 0.5)
    assert rate_factors(specs, 2, 3) == (0.5, 0.5, 0.25)  # overlapping ones multiply
    assert rate_factors(specs, 4, 3) == (1.0, 1.0, 1.0)  # tenants are not rate changes
    assert tenant_shares(specs, 1, 3) == {}
    assert tenant_shares(specs, 2, 3) == {1: 0.75}
    assert tenant_shares(specs, 3, 3) == {1: 1 - 0.25 * 0.5}
    assert tenant_targets(specs, 3) == [1]


def test_step_reports_and_controller_decisions(tmp_path):
    assert job_step(tmp_path, 3) is None
    report_step(tmp_path, 0, 4)
    report_step(tmp_path, 2, 5)
    assert job_step(tmp_path, 3) == 5  # the furthest rank
    StepReporter(1, str(tmp_path)).on_step_begin(7)
    assert job_step(tmp_path, 3) == 7
    StepReporter(1, "").on_step_begin(9)  # outside a shaped run: nothing is written
    assert job_step(tmp_path, 3) == 7
    specs = [
        PreemptionSpec(factor=0.5, start_step=1, end_step=2, ranks=[2]),
        PreemptionSpec(factor=0.5, start_step=2, end_step=3, ranks=[2], kind="tenant"),
    ]
    ran: list[str] = []
    started: list[dict[int, float]] = []

    class FakeTenant:
        def poll(self):
            return 0  # already exited: nothing to stop

    def start_tenant(shares):
        started.append(shares)
        return FakeTenant()

    net = NetworkEmulationConfig(mode="shaped", bandwidth_gbps=0.2, preemptions=specs)
    controller = Controller(
        Topology("chs-abc123-", 3, tenant=True),
        rank_directions(net, 3),
        specs,
        str(tmp_path),
        start_tenant,  # type: ignore[arg-type]
        run=lambda argv: ran.append(" ".join(argv)),
    )
    controller.apply(0)
    assert ran == [] and started == []
    controller.apply(1)
    assert len(ran) == 2 and all("rate 100000000bit" in c for c in ran)
    assert "chs-abc123-r2" in ran[0] and "dev p2" in ran[1]  # both directions of rank 2 only
    ran.clear()
    controller.apply(2)
    assert len(ran) == 2 and all("rate 200000000bit" in c for c in ran)  # restored
    assert started == [{2: 0.5}]
    controller.apply(3)
    assert [a.step for a in controller.applied] == [1, 2, 3]
    assert controller.applied[-1].shares == {}


def test_capability_errors_are_one_line_naming_the_field():
    with pytest.raises(ConfigError) as error:
        check_shaped_support(euid=1000, which=lambda tool: f"/usr/sbin/{tool}")
    message = str(error.value)
    assert message.startswith("emulation.network.mode: shaped needs root")
    assert "use mode: model" in message and "\n" not in message
    with pytest.raises(ConfigError, match=r"needs `tc` \(iproute2\)"):
        check_shaped_support(euid=0, which=lambda tool: None if tool == "tc" else "/x")
    check_shaped_support(euid=0, which=lambda tool: "/x")
    with pytest.raises(ConfigError, match="NCCL runs .* are not shaped"):
        check_shaped_device("cuda")
    check_shaped_device("auto")


@pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2 to list namespaces")
def test_refusal_comes_before_anything_is_created():
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

    def refuse():
        check_shaped_support(euid=1000)

    with pytest.raises(ConfigError, match="emulation.network.mode"):
        run_shaped(NET, 2, ["true"], prefix="chs-refuse-", check=refuse)
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "chs-refuse-" not in after and before.count("chs-") == after.count("chs-")


def test_interceptor_gets_no_network_model_in_shaped_mode(monkeypatch):
    shaped = EmulationConfig(network=NET)
    with pytest.raises(ConfigError, match="emulation.network.mode: shaped needs ranks started"):
        build_interceptor(shaped, 0, 3, torch.device("cpu"))
    monkeypatch.setenv(SHAPED_ENV, "chs-abc123-")
    assert build_interceptor(shaped, 0, 3, torch.device("cpu")).network is None
    modelled = EmulationConfig(network=NetworkEmulationConfig(bandwidth_gbps=0.2))
    assert build_interceptor(modelled, 0, 3, torch.device("cpu")).network is not None


def test_config_mode_and_new_fields_load_from_yaml_dicts():
    run = from_dict(
        RunConfig,
        {
            "emulation": {
                "network": {
                    "mode": "shaped",
                    "bandwidth_gbps": 0.2,
                    "links": [{"ranks": [0, 1], "bandwidth_gbps": 1, "reverse_bandwidth_gbps": 2}],
                    "preemptions": [{"factor": 0.5, "kind": "tenant", "ranks": [1]}],
                }
            }
        },
    )
    net = run.emulation.network
    assert net.mode == "shaped" and net.links[0].reverse_bandwidth_gbps == 2
    assert net.preemptions[0].kind == "tenant"
    assert NetworkEmulationConfig().mode == "model"  # the default keeps old configs as they were
    with pytest.raises(ConfigError, match="mode"):
        from_dict(RunConfig, {"emulation": {"network": {"mode": "real"}}})


def test_tenant_refuses_addresses_outside_a_shaped_run():
    with pytest.raises(SystemExit, match="not an address of a shaped run"):
        push({"127.0.0.1": 1e6}, 5201, max_bytes=1, max_seconds=0.1)


def test_train_command_refuses_shaped_mode_without_root(tmp_path, monkeypatch, capsys):
    from colossal_hetero.cli import main

    config = {
        "model": {"arch": "gpt2", "hf": {"n_layer": 1, "n_embd": 16, "n_head": 2}},
        "data": {"seq_len": 8, "global_batch_size": 2},
        "parallel": {"tp": 2},
        "cluster": {"device": "cpu"},
        "train": {"steps": 1, "eval_every": 0},
        "logging": {"dir": str(tmp_path / "run"), "progress": False, "plot": False},
        "emulation": {"network": {"mode": "shaped", "bandwidth_gbps": 0.2}},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # as a user without root
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("colossal-hetero: "), err
    assert err[0].endswith(
        "emulation.network.mode: shaped needs root to build network namespaces and tc links; "
        "use mode: model (sleeps the modelled time, no privileges)"
    )
