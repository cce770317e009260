"""MoeComm.flush waits for the oldest chunk of any gradient group first, refilling that
group's window at once (fake reducers: launch times and window given by hand)."""

from __future__ import annotations

from collections import deque

from colossal_hetero.moe.comm import MoeComm


class _FakeReducer:
    """Chunks with given launch times; ``window`` on the wire at once, the rest queued; a wait
    finishes the oldest and launches the next queued chunk at ``clock[0]``."""

    def __init__(self, name: str, launches: list[float], window: int, log: list, clock: list):
        self.name, self.log, self.clock = name, log, clock
        self.queued = deque(launches[window:])
        self.inflight = deque(launches[:window])
        self.touched = True

    def launch_rest(self) -> None:
        self.log.append(("launch_rest", self.name))

    def oldest_launch(self) -> float | None:
        return self.inflight[0] if self.inflight else None

    def wait_oldest(self) -> None:
        self.log.append(("wait", self.name, self.inflight.popleft()))
        self.clock[0] += 1.0
        if self.queued:
            self.queued.popleft()
            self.inflight.append(self.clock[0])

    def wait_all(self) -> None:
        assert not self.inflight and not self.queued
        self.log.append(("wait_all", self.name))


def test_flush_waits_oldest_first_across_groups() -> None:
    log: list = []
    clock = [10.0]
    dense = _FakeReducer("dense", [1.0, 4.0], window=2, log=log, clock=clock)
    expert = _FakeReducer("expert", [2.0, 3.0, 99.0], window=2, log=log, clock=clock)
    comm = MoeComm()
    comm.attach({"dense": dense, "expert": expert})  # type: ignore[dict-item]
    comm.flush()
    # Oldest first: dense 1, expert 2, expert 3; expert's third chunk is launched when its
    # first finishes (at clock 12), so it comes after dense 4 (launched before it).
    assert log == [
        ("launch_rest", "dense"),
        ("launch_rest", "expert"),
        ("wait", "dense", 1.0),
        ("wait", "expert", 2.0),
        ("wait", "expert", 3.0),
        ("wait", "dense", 4.0),
        ("wait", "expert", 12.0),
        ("wait_all", "dense"),
        ("wait_all", "expert"),
    ]
