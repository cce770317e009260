"""Stamped p2p completions (``emulation/arrival.py``) against hand-computed values.

The works are fakes whose ``wait()`` blocks on an event the test releases, and the clock is
a counter, so every stamp's value and order is deterministic whatever the machine's load.
"""

from __future__ import annotations

import itertools
import threading

import pytest

from colossal_hetero.emulation.arrival import ArrivalLink, CompletionWatch, StreamOrder


class _Work:
    """A real work's stand-in: ``wait()`` blocks until released, then returns or raises."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.released, self.error, self.waits = threading.Event(), error, 0

    def wait(self) -> bool:
        self.waits += 1
        self.released.wait()
        if self.error is not None:
            raise self.error
        return True


def _clock() -> object:
    ticks = itertools.count(1)
    lock = threading.Lock()

    def clock() -> float:
        with lock:
            return float(next(ticks))

    return clock


def test_completion_is_the_latest_of_booking_data_and_the_message_before() -> None:
    order = StreamOrder()
    a1, a2, b1, a3, a4 = (order.issue() for _ in range(5))
    # Alone: the data moved at 1.0 and takes 0.5; the booking (0.2) is earlier.
    assert order.completion("a", a1, 1.0, 0.5, 0.2) == 1.5
    # Behind a1 on the same connection: starts when a1 completed (1.5), not when it moved.
    assert order.completion("a", a2, 1.1, 0.5, 0.0) == 2.0
    # Another connection does not wait for "a".
    assert order.completion("b", b1, 1.1, 0.5, 0.0) == 1.6
    # A booking later than everything else stands.
    assert order.completion("a", a4, 0.0, 0.5, 9.0) == 9.0
    # Settled after a later message: no ordering term, and the later one stays the last.
    assert order.completion("a", a3, 2.0, 0.5, 0.0) == 2.5
    assert order.completion("a", order.issue(), 0.0, 1.0, 0.0) == 10.0  # behind a4's 9.0


def test_works_of_one_connection_are_stamped_in_order_and_others_apart() -> None:
    watch = CompletionWatch(_clock())
    first, second, other = _Work(), _Work(), _Work()
    stamps = [watch.watch("a", first), watch.watch("a", second), watch.watch("b", other)]
    other.released.set()  # "b" completes while "a" is still blocked
    assert stamps[2].join() == (True, 1.0)
    second.released.set()  # released before the first: still stamped after it
    first.released.set()
    (_, at_first), (_, at_second) = stamps[0].join(), stamps[1].join()
    assert at_first < at_second
    assert (first.waits, second.waits, other.waits) == (1, 1, 1)  # each waited exactly once
    watch.close()


def test_a_failed_wait_is_raised_at_join_and_close_ends_the_threads() -> None:
    watch = CompletionWatch(_clock())
    broken = _Work(RuntimeError("peer gone"))
    stamp = watch.watch(("group", False, 1, 0), broken)
    broken.released.set()
    with pytest.raises(RuntimeError, match="peer gone"):
        stamp.join()
    watch.close()
    threads = [t for t in threading.enumerate() if t.name == "p2p-completion"]
    for thread in threads:
        thread.join(timeout=5)
    assert not any(t.is_alive() for t in threads)


def test_receives_are_booked_as_their_data_arrives_and_share_the_direction() -> None:
    """Receives watched long before their data (posted early) book nothing until it arrives;
    two arriving together share the receiving direction (queue 0: no wait, then half rate
    each), and a later one on a free direction takes its modelled time alone."""
    now = [0.0]

    class _Arriving(_Work):
        def __init__(self, at: float) -> None:
            super().__init__()
            self.at = at

        def wait(self) -> bool:
            super().wait()
            now[0] = self.at  # the clock the watching thread reads next
            return True

    watch, link = CompletionWatch(lambda: now[0]), ArrivalLink(0.0)
    works = [_Arriving(10.0), _Arriving(10.5), _Arriving(20.0)]
    stamps = [watch.watch(c, w, (link, 1.0, None)) for c, w in zip("aba", works, strict=True)]
    for work, stamp in zip(works, stamps, strict=True):
        work.released.set()
        stamp.join()  # one at a time: each thread's clock read is its own work's time
    first, second, third = (link.completion(s.booking) for s in stamps if s.booking)
    # From 10.5 both share: the first's last 0.5 s takes 1 s, the second's 1 s then 0.5 more.
    assert (first, second) == (11.5, 12.0)
    assert third == 21.0  # from its arrival, not from when it was watched
    watch.close()


def test_each_link_class_receives_apart_and_a_failed_booking_is_raised_at_join() -> None:
    """Receives on two classes of the link (a listed peer's and the default) do not share a
    rate: each takes its modelled time alone. A booking that fails in the watching thread is
    raised at ``join``, not lost in the thread (a lost one would leave the caller blocked)."""
    link = ArrivalLink(0.0)
    slow = link.book(10.0, 4.0, "pp", None)
    fast = link.book(10.0, 1.0, "tp", 1)
    assert (link.completion(slow), link.completion(fast)) == (14.0, 11.0)
    shared = link.book(10.0, 4.0, "dp", None)  # the default class again: shares with `slow`
    assert (link.completion(slow), link.completion(shared)) == (18.0, 18.0)
    watch, work = CompletionWatch(_clock()), _Work()
    stamp = watch.watch("a", work, (link, -1.0, None))  # a negative time: book refuses it
    work.released.set()
    with pytest.raises(ValueError, match="durations"):
        stamp.join()
    watch.close()
