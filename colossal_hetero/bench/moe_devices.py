"""``bench moe``'s emulated devices: every rank of every variant computes on a device of its own.

Four ranks share two cores, so a rank's compute and the communication threads of gloo (its own
and its neighbours') compete for the same cores: a gradient chunk sent during backward slows
that backward by about what it hides, and overlap cannot pay off as it does with one GPU per
rank. With ``stretch="dedicated"`` every rank emulates a device ``DEVICE_BASE`` times slower
than a core, as ``bench dynamic`` and ``bench pipeline`` (c) do: at every collective (and at
the step's end) the interceptor makes the compute since the previous one last ``DEVICE_BASE``
times the thread's CPU time of it, sleeping what the contended wall time left. The sleep burns
no CPU, so the communication threads get the cores while a rank "computes", as on GPUs; the
sleep scales with the work each rank really did between its collectives, so every variant's
step still comes from its own code. The same emulation applies to every variant of one run:
our plugins carry it as their ``emulation`` (their seam opens and closes each step), the stock
plugin and DeepSpeed-MoE run each step inside a ``StepScope`` over an interceptor of the same
emulation. ``stretch="none"``: no emulated device (the benchmark as before session 9).

A compute interval is cut only where the interceptor sees a collective; a collective it missed
would merge two intervals and hide the wait between them in the stretch (the variant would be
stretched less). ``PgCalls`` checks this from below: it counts every process-group call
(``ProcessGroup.allreduce``, ``alltoall_base``, ... on which every torch.distributed function
ends) made in the step's thread, and those made while no intercepted collective of the step's
interceptor runs (``missed``).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from colossal_hetero.bench.pipeline_stretch import DEVICE_BASE
from colossal_hetero.config.schema import EmulationConfig, SlowdownSpec

Stretch = Literal["dedicated", "none"]
STRETCHES: tuple[str, ...] = ("dedicated", "none")
PG_METHODS = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "_allgather_base",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "alltoall",
    "alltoall_base",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced",
    "broadcast",
    "reduce",
    "barrier",
    "send",
    "recv",
    "recv_anysource",
    "gather",
    "scatter",
)
"""The ``ProcessGroup`` methods torch.distributed's collectives and point-to-point calls end in."""


def device_emulation(world_size: int, stretch: str) -> EmulationConfig:
    """Every rank on a device ``DEVICE_BASE`` times slower than a core (``dedicated``), or no
    emulation (``none``)."""
    if stretch not in STRETCHES:
        raise ValueError(f"stretch: one of {STRETCHES}, got {stretch!r}")
    if stretch == "none":
        return EmulationConfig()
    return EmulationConfig(
        compute=[SlowdownSpec(rank=r, factor=DEVICE_BASE) for r in range(world_size)]
    )


def describe(stretch: str) -> str:
    """The emulation in words, for the JSON."""
    if stretch == "none":
        return "none: 4 ranks share 2 cores, communication threads compete with compute"
    return (
        f"dedicated: every rank of every variant on a device {DEVICE_BASE}x slower than a core, "
        "each compute interval between collectives lasting that times its thread CPU time "
        "(the interceptor's stretch='dedicated'), sleeping what the wall time left"
    )


def stretch_interceptor(emulation: EmulationConfig, device: torch.device, stretch: str) -> Any:
    """An installed interceptor of ``emulation`` (timing only when it is off) that stretches
    like our plugins' do; the stock plugin's and DeepSpeed's steps run inside it."""
    from colossal_hetero.emulation import build_interceptor

    interceptor = build_interceptor(emulation, dist.get_rank(), dist.get_world_size(), device)
    if stretch == "dedicated":
        interceptor.stretch = "dedicated"
    return interceptor.install()


class PgCalls:
    """Process-group calls made in this thread while ``watch`` is set (see the module doc)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.watch: Any = None  # the interceptor of the step under way
        self.calls = self.missed = 0

    def note(self) -> None:
        watch = self.watch
        if watch is None or threading.get_ident() != self.thread:
            return
        self.calls += 1
        # `_depth` > 0 while one of the interceptor's wrapped collectives runs (its own state).
        if not (watch.stepping_here() and getattr(watch, "_depth", 0) > 0):
            self.missed += 1

    @contextmanager
    def watching(self, interceptor: Any) -> Iterator[dict[str, float]]:
        """Count the calls of one step; the yielded dict gets ``pg_calls`` and ``missed``."""
        self.watch, self.calls, self.missed = interceptor, 0, 0
        counts: dict[str, float] = {}
        try:
            yield counts
        finally:
            self.watch = None
            counts.update(pg_calls=float(self.calls), missed=float(self.missed))


@contextmanager
def _patched(owner: Any, wrappers: dict[str, Callable[..., Any]]) -> Iterator[None]:
    """Set ``owner``'s attributes to ``wrappers`` for the block; the originals come back at
    exit, also after an error."""
    originals = {name: getattr(owner, name) for name in wrappers}
    for name, wrapper in wrappers.items():
        setattr(owner, name, wrapper)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(owner, name, original)


@contextmanager
def counting_pg_calls() -> Iterator[PgCalls]:
    """Wrap ``ProcessGroup``'s collective methods to count into a ``PgCalls`` (restored at
    exit)."""
    group_type = torch._C._distributed_c10d.ProcessGroup
    counter = PgCalls()

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(group: Any, *args: Any, **kwargs: Any) -> Any:
            counter.note()
            return original(group, *args, **kwargs)

        return counted

    names = [n for n in PG_METHODS if hasattr(group_type, n)]
    with _patched(group_type, {n: wrap(getattr(group_type, n)) for n in names}):
        yield counter


@contextmanager
def scoped_step(interceptor: Any, counter: PgCalls, index: int) -> Iterator[dict[str, float]]:
    """One step of a variant that has no seam (stock, DeepSpeed): ``interceptor``'s step is
    open inside (the compute stretched, the last interval at the end), its calls counted."""
    with counter.watching(interceptor) as counts:
        interceptor.begin_step(index)
        try:
            yield counts
        finally:
            interceptor.end_step()


@dataclass(frozen=True)
class Devices:
    """What ``emulated_devices`` set up for one rank of ``bench moe``."""

    emulation: EmulationConfig
    """Every rank's device (our plugins are built with it)."""
    stretch: str
    clock: Any
    """The installed interceptor in which the stock and DeepSpeed steps run."""
    counter: PgCalls
    timer: CollectiveTimer


@contextmanager
def emulated_devices(world_size: int, device: torch.device, stretch: str) -> Iterator[Devices]:
    """Set up, in this order: the collective timer (beneath every interceptor), the stock and
    DeepSpeed steps' interceptor (installed before any variant is built: DeepSpeed binds some
    torch.distributed functions when it initialises, and so binds the interceptors' wrappers),
    the process-group call counter. Undone at exit."""
    emulation = device_emulation(world_size, stretch)
    with CollectiveTimer().installed() as timer:
        clock = stretch_interceptor(emulation, device, stretch)
        try:
            with counting_pg_calls() as counter:
                yield Devices(emulation, stretch, clock, counter, timer)
        finally:
            clock.uninstall()


# -- the stock step's communication --------------------------------------------------------

_TIMED = ("all_reduce", "all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor")


class CollectiveTimer:
    """Times this thread's synchronous calls of ``_TIMED`` while ``recording``, from beneath
    the interceptors: ``installed`` wraps ``torch.distributed``'s functions before any
    interceptor does, so the router wraps these wrappers, and a call is timed from after the
    interceptor's stretch of the compute before it (timed above the router, the slowest
    rank's stretch would count as communication)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.calls: list[tuple[float, float, tuple[int, ...]]] | None = None

    @contextmanager
    def installed(self) -> Iterator[CollectiveTimer]:
        """Wrap the functions for the block's duration (no interceptor may be installed)."""
        if getattr(dist.all_reduce, "_colossal_hetero_router", None) is not None:
            raise RuntimeError("CollectiveTimer: install it before any interceptor")
        with _patched(dist, {name: self._wrap(getattr(dist, name)) for name in _TIMED}):
            yield self

    @contextmanager
    def recording(self) -> Iterator[list[tuple[float, float, tuple[int, ...]]]]:
        """Each call's ``(start, end, global ranks of its group)`` goes to the yielded list."""
        calls: list[tuple[float, float, tuple[int, ...]]] = []
        self.calls = calls
        try:
            yield calls
        finally:
            self.calls = None

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)  # the interceptor reads the parameters through __wrapped__
        def timed(*args: Any, **kwargs: Any) -> Any:
            calls = self.calls
            if kwargs.get("async_op") or calls is None or threading.get_ident() != self.thread:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                calls.append((start, time.perf_counter(), group_ranks(args, kwargs)))

        return timed


def group_ranks(args: tuple, kwargs: dict[str, Any]) -> tuple[int, ...]:
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def transfer_time(calls: list[Any]) -> float | None:
    """Seconds this rank's synchronous collectives spent after their group's last member
    arrived (the communication itself, without waiting for slower peers); None when the
    ranks' call counts differ (then no call-by-call matching). Collective (all ranks)."""
    count = torch.tensor([len(calls), -len(calls)], dtype=torch.float64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if int(count[0]) != -int(count[1]):
        return None
    starts = torch.tensor([c[0] for c in calls], dtype=torch.float64)
    flat = starts.new_empty(dist.get_world_size() * len(calls))  # gloo: a flat output
    dist.all_gather_into_tensor(flat, starts)
    everyone = flat.view(dist.get_world_size(), len(calls))
    total = 0.0
    for i, (_, end, ranks) in enumerate(calls):
        total += max(0.0, end - float(everyone[list(ranks), i].max()))
    return total


def boundary_summary(series: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per variant: the most process-group calls of one rank in a measured step, and the most
    of them made outside an intercepted collective (0: every boundary seen)."""
    names = sorted({key.rsplit(".", 1)[0] for key in series if key.endswith(".missed")})
    return {
        name: {
            "pg_calls_per_step": max(series[f"{name}.pg_calls"]),
            "missed_max": max(series[f"{name}.missed"]),
        }
        for name in names
    }
