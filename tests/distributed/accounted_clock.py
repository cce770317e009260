"""A load-independent clock for the balancer's distributed tests.

The interceptor (colossal_hetero/emulation/interceptor.py) takes ``clock`` and ``sleep`` as
seams. Here its clock is the thread's CPU time plus every emulated sleep it asked for, so a
step's compute is exactly what the emulation accounts: each interval's CPU work, stretched
by the rank's factor. The sleeps still happen in wall time (the slowed rank really makes its
peers wait), but a loaded host, which delays a rank's wakeups and lets it wait for a core,
no longer moves the compute the detector reads: a 2x rank reads 2x whatever the load, up to
the noise of CPU time itself. Collectives block without working, so their waits read near 0
on this clock; the detector never looks at them.
"""

from __future__ import annotations

import time
from typing import Any


def account_in_cpu_time(timer: Any) -> None:
    """Make ``timer`` (a ``CollectiveInterceptor``, before its first step) read CPU time plus
    the sleeps it requested."""
    slept = [0.0]

    def clock() -> float:
        return time.thread_time() + slept[0]

    def sleep(seconds: float) -> None:
        slept[0] += seconds
        time.sleep(seconds)

    timer._clock, timer._sleep = clock, sleep
