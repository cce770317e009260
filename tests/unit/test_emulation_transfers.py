"""The interceptor's model mode: transfers complete at issue + modelled time on a FIFO link,
``wait()`` sleeps only what remains, and per-kind bytes and waits are accounted.

No process group: torch.distributed's functions are replaced by fakes (same parameter names)
before the interceptor installs, and the interceptor gets a fake clock whose ``sleep`` records
the request and advances time by it. Every assertion is on accounted quantities, exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from colossal_hetero.emulation import CollectiveInterceptor, NetworkModel

# A power of two (bytes/s), so that every modelled time below is a multiple of 1/64 s, exact in
# binary: completion times and sleeps then compare exactly. A p2p of B bytes takes B / BANDWIDTH.
BANDWIDTH = float(2**20)
SIXTY_FOURTH = 2**14  # bytes that take 1/64 s


class FakeClock:
    """Time that moves only when told: ``sleep`` records its request and advances by it."""

    def __init__(self) -> None:
        self.now = 1.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def compute(self, seconds: float) -> None:
        self.now += seconds


class FakeWork:
    """An async work; ``late`` s pass inside ``wait()`` when it had not completed (a peer that
    arrives late)."""

    def __init__(self, clock: FakeClock, done: bool, late: float = 0.0) -> None:
        self.clock, self.done, self.late = clock, done, late

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            self.clock.compute(self.late)
            self.done = True
        return True


class Fakes:
    """Stand-ins for the wrapped collectives: each advances the clock by its ``cost`` entry
    (the real call's own duration) and returns works that are done unless ``done`` is False."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.done, self.late = clock, True, 0.0
        self.cost: dict[str, float] = {}

    def _call(self, name: str, async_op: bool) -> FakeWork | None:
        self.clock.compute(self.cost.get(name, 0.0))
        return FakeWork(self.clock, self.done, self.late) if async_op else None

    def all_reduce(self, tensor: Any, op: Any = None, group: Any = None, async_op: bool = False):
        return self._call("all_reduce", async_op)

    def all_to_all_single(
        self,
        output: Any,
        input: Any,
        output_split_sizes: Any = None,
        input_split_sizes: Any = None,
        group: Any = None,
        async_op: bool = False,
    ):
        return self._call("all_to_all_single", async_op)

    def all_gather(self, tensor_list: Any, tensor: Any, group: Any = None, async_op=False):
        return self._call("all_gather", async_op)

    def broadcast(self, tensor: Any, src: int, group: Any = None, async_op: bool = False):
        return self._call("broadcast", async_op)

    def send(self, tensor: Any, dst: int, group: Any = None, tag: int = 0) -> None:
        self._call("send", False)

    def recv(self, tensor: Any, src: Any = None, group: Any = None, tag: int = 0) -> int:
        self._call("recv", False)
        return 1

    def batch_isend_irecv(self, p2p_op_list: list[Any]) -> list[FakeWork]:
        self.clock.compute(self.cost.get("batch_isend_irecv", 0.0))
        return [FakeWork(self.clock, self.done, self.late) for _ in p2p_op_list]

    def all_gather_object(self, object_list: Any, obj: Any, group: Any = None) -> None:
        # As torch's does: tensor collectives inside, looked up on the module at call time.
        dist.all_gather([torch.zeros(4, dtype=torch.int64)] * 2, torch.zeros(4, dtype=torch.int64))
        dist.all_gather([torch.zeros(8)] * 2, torch.zeros(8))


FAKED = (
    "all_reduce",
    "all_to_all_single",
    "all_gather",
    "broadcast",
    "send",
    "recv",
    "batch_isend_irecv",
    "all_gather_object",
)


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeClock, Fakes]]:
    clock = FakeClock()
    fakes = Fakes(clock)
    for name in FAKED:
        for module in (dist, c10d):
            monkeypatch.setattr(module, name, getattr(fakes, name))
    yield clock, fakes


def _interceptor(
    clock: FakeClock, modelled: bool = True, queue: float = 2 / 64, rendezvous: bool = True
) -> CollectiveInterceptor:
    network = NetworkModel(
        world_size=2,
        enabled=True,
        default_bandwidth=BANDWIDTH,
        queue=queue,
        rendezvous=rendezvous,
    )
    return CollectiveInterceptor(
        0, 2, network=network if modelled else None, sleep=clock.sleep, clock=clock
    )


def _floats(sixty_fourths: int) -> torch.Tensor:
    """A float32 tensor whose transfer takes ``sixty_fourths`` / 64 s on the modelled link."""
    return torch.zeros(sixty_fourths * SIXTY_FOURTH // 4)


def _isend(tensor: torch.Tensor) -> list[Any]:
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, 1)])


def _irecv(tensor: torch.Tensor) -> list[Any]:
    return dist.batch_isend_irecv([dist.P2POp(dist.irecv, tensor, 1)])


@pytest.mark.parametrize("compute_64ths", [0, 1, 3, 4, 6])
def test_overlapped_isend_costs_what_remains_at_wait(rig: Any, compute_64ths: int) -> None:
    clock, _ = rig
    transfer, compute = 4 / 64, compute_64ths / 64
    with _interceptor(clock) as ic, ic.step(0):
        (work,) = _isend(_floats(4))
        clock.compute(compute)  # the rank computes while the bytes move
        work.wait()
        work.wait()  # a second wait owes nothing
    remaining = max(0.0, transfer - compute)
    assert clock.sleeps == ([remaining] if remaining > 0 else [])
    timing = ic.last_timing
    assert timing.network_delay == timing.comm_wait == remaining
    assert timing.wait_by_kind["p2p"] == remaining and timing.compute_time == compute
    assert timing.bytes_by_kind["p2p"] == 4 * SIXTY_FOURTH


def test_a_late_peer_delays_the_transfer_to_the_real_completion(rig: Any) -> None:
    """A work still running at wait() (its peer had not posted) cannot have moved bytes since
    issue: its transfer takes the full modelled time after the real wait returns."""
    clock, fakes = rig
    fakes.done, fakes.late = False, 5 / 64
    with _interceptor(clock) as ic, ic.step(0):
        (work,) = _irecv(_floats(4))
        clock.compute(2 / 64)
        work.wait()  # the sender shows up 5/64 s into the wait
    assert clock.sleeps == [4 / 64]
    assert ic.last_timing.comm_wait == 5 / 64 + 4 / 64
    assert ic.last_timing.bytes_by_kind["p2p"] == 0  # receiving sends nothing


def test_a_wait_that_barely_blocks_keeps_the_overlap(rig: Any) -> None:
    """gloo's send and recv works never report completion before wait(): one whose wait
    returns within a tenth of the transfer's time found its bytes there, and keeps its overlap."""
    clock, fakes = rig
    fakes.done, fakes.late = False, 1 / 64  # under 16/64 / 10
    with _interceptor(clock) as ic, ic.step(0):
        (work,) = _isend(_floats(16))
        clock.compute(8 / 64)
        work.wait()
    assert clock.sleeps == [16 / 64 - 8 / 64 - 1 / 64]
    assert ic.last_timing.comm_wait == 8 / 64


def test_two_concurrent_transfers_on_one_link_take_the_sum(rig: Any) -> None:
    clock, _ = rig
    with _interceptor(clock) as ic, ic.step(0):
        (first,) = _isend(_floats(3))
        (second,) = _isend(_floats(2))
        second.wait()  # queued behind the first: completes at 3/64 + 2/64
        first.wait()  # done by then
    assert clock.sleeps == [5 / 64]
    assert ic.last_timing.network_delay == 5 / 64


def test_a_send_and_a_receive_overlap_on_a_full_duplex_link(rig: Any) -> None:
    clock, _ = rig
    with _interceptor(clock, rendezvous=False) as ic, ic.step(0):
        (sent,) = _isend(_floats(3))
        (received,) = _irecv(_floats(2))
        received.wait()
        sent.wait()
    assert clock.sleeps == [2 / 64, 1 / 64]  # each direction on its own: 2/64, then 3/64
    assert ic.last_timing.network_delay == 3 / 64


def test_a_receive_waits_for_its_ready_notice_behind_the_send(rig: Any) -> None:
    """Rendezvous: the receive's ready notice leaves on the egress, behind the send's bytes
    (at most the 2/64 queue), so its data starts at 2/64 and arrives at 4/64; the send is done
    at 3/64 by then."""
    clock, _ = rig
    with _interceptor(clock) as ic, ic.step(0):
        (sent,) = _isend(_floats(3))
        (received,) = _irecv(_floats(2))
        received.wait()
        sent.wait()
    assert clock.sleeps == [4 / 64]
    assert ic.last_timing.network_delay == 4 / 64


def test_a_sync_call_queues_behind_an_async_one_in_flight(rig: Any) -> None:
    """The all-to-all waits for the all-reduce already on the link (head-of-line blocking)."""
    clock, fakes = rig
    fakes.cost["all_to_all_single"] = 1 / 64  # the real call returns 1/64 s after issue
    with _interceptor(clock) as ic, ic.step(0):
        work = dist.all_reduce(_floats(8), async_op=True)  # 2(n-1)/n * B / bw = 8/64 s
        dist.all_to_all_single(torch.empty(0), _floats(4))  # (n-1)/n * B / bw = 2/64 s
        work.wait()
    # Booked at its real return (1/64) behind the all-reduce (free at 8/64): done at 10/64.
    assert clock.sleeps == [10 / 64 - 1 / 64]
    timing = ic.last_timing
    assert timing.wait_by_kind["all_to_all"] == 10 / 64 and timing.wait_by_kind["all_reduce"] == 0
    assert timing.comm_wait == 10 / 64


def test_another_group_waits_for_the_queue_then_shares_the_link(
    rig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two process groups are two connections: the all-to-all waits behind the link's queue
    (2/64 s of traffic), not behind the whole all-reduce, and then the two share the link."""
    clock, fakes = rig
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    gradients, experts = object(), object()  # stand-ins for two process groups of ranks 0, 1
    fakes.cost["all_to_all_single"] = 1 / 64
    with _interceptor(clock) as ic, ic.step(0):
        work = dist.all_reduce(_floats(8), group=gradients, async_op=True)  # 8/64 s
        dist.all_to_all_single(torch.empty(0), _floats(4), group=experts)  # 2/64 s
        work.wait()
    # The all-to-all is booked at 1/64. Its ready notices cross the other direction behind the
    # all-reduce's queue (2/64), then its data waits behind the queue (2/64): it starts at 5/64.
    # Sharing the link at half the rate, its 2/64 s take 4/64: done at 9/64 (sleeps 8/64). The
    # all-reduce moved 5/64 alone, 2/64 shared, and its last 1/64 alone: done at 10/64, the sum
    # of both (sleeps 10/64 - 9/64).
    assert clock.sleeps == [8 / 64, 1 / 64]
    timing = ic.last_timing
    assert (
        timing.wait_by_kind["all_to_all"] == 9 / 64 and timing.wait_by_kind["all_reduce"] == 1 / 64
    )
    # Without the rendezvous only the data waits: starts at 3/64, done at 7/64, then 10/64.
    clock.sleeps.clear()
    with _interceptor(clock, rendezvous=False) as ic, ic.step(1):
        work = dist.all_reduce(_floats(8), group=gradients, async_op=True)
        dist.all_to_all_single(torch.empty(0), _floats(4), group=experts)
        work.wait()
    assert clock.sleeps == [6 / 64, 3 / 64]


def test_a_listed_link_is_a_class_of_its_own_and_unlisted_peers_share_the_default(
    rig: Any,
) -> None:
    """As shaped mode's tc classes: a message to rank 1 (its link listed) does not queue behind
    the default class's traffic, while messages to the unlisted ranks 2 and 3 share the default
    class (here one connection: first in, first out)."""
    clock, _ = rig
    network = NetworkModel(
        world_size=4,
        enabled=True,
        default_bandwidth=BANDWIDTH,
        links={(0, 1): (BANDWIDTH, 0.0)},
        queue=2 / 64,
    )
    with CollectiveInterceptor(0, 4, network=network, sleep=clock.sleep, clock=clock) as ic:
        with ic.step(0):
            (to_two,) = dist.batch_isend_irecv([dist.P2POp(dist.isend, _floats(8), 2)])
            (to_three,) = dist.batch_isend_irecv([dist.P2POp(dist.isend, _floats(2), 3)])
            (to_one,) = dist.batch_isend_irecv([dist.P2POp(dist.isend, _floats(2), 1)])
            to_one.wait()  # alone on its class: 2/64
            to_three.wait()  # behind the 8/64 to rank 2: done at 10/64
            to_two.wait()  # done at 8/64 already
    assert clock.sleeps == [2 / 64, 8 / 64]
    assert ic.last_timing.network_delay == 10 / 64


def test_transfers_stay_booked_across_steps_and_waits_outside_steps_are_not_counted(
    rig: Any,
) -> None:
    clock, _ = rig
    with _interceptor(clock) as ic:
        with ic.step(0):
            (work,) = _isend(_floats(4))
        work.wait()  # outside a step: sleeps what remains, counted nowhere
        with ic.step(1):
            (early,) = _isend(_floats(2))
        with ic.step(2):
            dist.send(_floats(2), 1)  # behind the isend of step 1: 4/64 after its issue
        early.wait()
    assert clock.sleeps == [4 / 64, 4 / 64]
    assert ic.last_timing.network_delay == 4 / 64 and ic.last_timing.step == 2


def test_bytes_by_kind_are_the_payloads_sent_and_waits_split_the_comm_wait(rig: Any) -> None:
    clock, fakes = rig
    fakes.cost = {"all_reduce": 0.5, "all_to_all_single": 0.25, "send": 0.125, "recv": 0.125}
    fakes.cost.update(batch_isend_irecv=0.0625, broadcast=0.03125, all_gather=0.015625)
    with _interceptor(clock, modelled=False) as ic, ic.step(0):
        dist.all_reduce(torch.zeros(1000))  # 4000 B
        dist.all_to_all_single(torch.empty(0), torch.zeros(300, dtype=torch.float64))  # 2400 B
        dist.send(torch.zeros(100, dtype=torch.int64), 1)  # 800 B
        dist.recv(torch.zeros(64))  # sends nothing
        ops = [
            dist.P2POp(dist.isend, torch.zeros(50, dtype=torch.float16), 1),  # 100 B
            dist.P2POp(dist.irecv, torch.zeros(70), 1),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        dist.broadcast(torch.zeros(16), src=0)  # this rank is the root: 64 B
        dist.broadcast(torch.zeros(16), src=1)  # receives
        dist.all_gather_object([None, None], {"x": 1})  # nested: 4 int64 + 8 float32 = 64 B
    timing = ic.last_timing
    assert timing.bytes_by_kind == {
        "all_reduce": 4000,
        "all_to_all": 2400,
        "p2p": 900,
        "other": 128,
    }
    assert timing.wait_by_kind == {
        "all_reduce": 0.5,
        "all_to_all": 0.25,
        "p2p": 0.125 + 0.125 + 0.0625,
        "other": 2 * 0.03125 + 2 * 0.015625,
    }
    assert timing.comm_wait == sum(timing.wait_by_kind.values())  # sums of binary fractions
    assert timing.num_collectives == 8 and clock.sleeps == []  # timing only: nothing slept
