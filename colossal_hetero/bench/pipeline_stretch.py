"""Emulated devices for ``bench pipeline``: stretch each block's own compute.

The collective interceptor stretches a rank's compute at its next collective, and it does not
see ``KFKBSchedule``'s ``isend``/``irecv``: under it, a stage would be slowed where Colossal-AI's
1F1B talks (``send``/``recv``) and not where kFkB does, which would favour one schedule. This
stretch is the same for every variant: around each transformer block that runs on a rank, it
times the block's forward and its backward (a *pass*) and sleeps at the end of each; the sleep
burns no CPU.

Two modes (``Stretch(mode=)``):

- ``added``: sleep ``(factor - 1)`` times the pass's wall time. On a shared, oversubscribed
  machine that sleep hands the rank's core to its neighbours, which then run faster: 4 ranks
  on 2 cores are CPU-bound, and a slow stage that sleeps speeds up every other stage, so a
  split that moves blocks off it gains far less than the slowdown says.
- ``dedicated``: a full-speed device's compute lasts ``base`` times the thread's CPU time of
  it, sleeping what its (contended) wall time left: a device of its own, ``base`` times slower
  than a core, that no neighbour speeds up or slows down while the contention stays below
  ``base`` (as the interceptor's ``stretch="dedicated"``). A device at ``1 / factor`` speed
  then computes ``(factor - 1) * base`` times that CPU time longer. Every rank of every phase
  runs on such devices (``Stretch.set_device`` between phases: phase (c) on slower ones, its
  slowed stage's with ``factor`` 2).

  *Intervals.* A tensor-parallel block synchronises its ranks inside each pass (all-reduces).
  Stretching the pass only at its end would serialise them: the slow rank's wall time already
  holds its wait for the partner's larger share, and its stretch comes on top, so a stage whose
  widths give the slow rank less work took ``fast share + slow extra`` per block where two real
  devices take ``max(slow, fast)`` (session 8: 1.59x the full-speed stage's block where the
  widths predicted ~1.4x). So while a pass runs, every collective this thread issues
  (``SYNC_NAMES`` on ``torch.distributed``; the wrappers are on for that pass only) first ends
  the compute interval since the previous one and stretches it on its own, and the interval
  after it starts when the call returns (an async call's ``wait()`` likewise): the waits
  inside the collective are no compute, and each rank arrives at the sync as late as its own
  device makes it. The same rule for every variant, so stock 1F1B on the even split is
  emulated alike. A pass without collectives (PP alone) is one interval, as before.

*Median work* (``median_work=True``, ``dedicated`` only; the bench's setting since session
21). The thread's CPU time for the same work moves with the host: on this project's shared VM
the same variant's step slept 2.6-4.0 s over one phase (c) as the host's speed drifted between
rounds, and the stretch multiplies that drift by ``base`` (and ``factor``), up to 12x, into
every variant's step. Each interval is then stretched by the median CPU time its *own* work
has taken so far, this time included: its key is the kind of block (:func:`work_signature`:
its modules' classes and parameter shapes, shared by every variant's model copy that holds such
a block), the direction (forward or backward) and its position in the pass (the collectives cut
a pass at the same points every time), so the samples are the same ops on the same shapes,
measured on this host. A variant that does more work (wider shards, more blocks) still measures
more; a drift of the host reaches the emulated device only as it moves the median. Keyed per
model copy at first, the same work cost one copy 7% less CPU than three others through a whole
phase (PP=4's (c): ``k2`` against ``k1``, ``k4`` and ``ada``, all on the same split): a
property of the host, not of the work, which the copies share to the op and the shape. (The
least, tried first, is an extreme of hundreds of samples: it read 0.67 of the mean CPU time,
so every device ran ~1.5x faster than the phases were sized for.) The pass's own wall time
still counts: the emulated device absorbs the host's slowness up to ``base``, as
``dedicated`` always did.

Backward is bracketed by two identity autograd functions: one on the block's output (its
backward runs first, and starts the pass) and one on the block's input (its backward runs
once the block's backward is done, and ends it). On CPU autograd runs backward on the calling
thread, one block after another, so the two marks bracket exactly that block's backward and
the thread's CPU time is that backward's work. A block whose input needs no gradient has no
end mark, so its backward is not opened (nothing stretched, as before).
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

from colossal_hetero.bench.pipeline_model import DEVICE_BASE
from colossal_hetero.emulation.collectives import WRAPPED_NAMES

SYNC_NAMES: tuple[str, ...] = tuple(n for n in WRAPPED_NAMES if not n.endswith("_object"))
"""The ``torch.distributed`` functions that end an interval inside a pass (the interceptor's
list; the object collectives run tensor ones inside, which end it already)."""

SYNC_MODULES: tuple[ModuleType, ...] = (dist, c10d)
"""Where callers look the functions up at call time (as ``emulation.router.MODULES``)."""

Clocks = tuple[float, float]
WorkSignature = tuple[tuple[str, str, tuple[tuple[int, ...], ...]], ...]
"""A block's work (:func:`work_signature`): per submodule, its name, class and parameter shapes."""
PassKey = tuple[int, bool]
"""A block pass: the block's serial (:meth:`Stretch.attach`) and whether it is the backward."""


class Stretch:
    """Shared switch and clocks of one rank's stretched blocks; ``enabled`` toggles all of them."""

    def __init__(
        self,
        factor: float,
        sleep: Callable[[float], None] = time.sleep,
        *,
        mode: Literal["added", "dedicated"] = "added",
        base: float = DEVICE_BASE,
        cpu_clock: Callable[[], float] = time.thread_time,
        wall_clock: Callable[[], float] = time.perf_counter,
        sync_modules: Sequence[Any] = SYNC_MODULES,
        median_work: bool = False,
    ) -> None:
        """``sleep``, ``cpu_clock``, ``wall_clock`` and ``sync_modules`` (whose ``SYNC_NAMES``
        functions a ``dedicated`` pass wraps) are seams for tests; every stretch is one call of
        ``sleep``. ``base`` and ``median_work`` (module doc, *Median work*) apply to
        ``dedicated`` mode only."""
        self._samples: dict[tuple[int, bool, int], list[float]] = {}
        """``median_work``: per (block serial, backward, position), its CPU seconds so far,
        sorted."""
        self.factor, self.base = 1.0, 1.0
        self.set_device(factor, base)
        self.mode = mode
        self.median_work = median_work and mode == "dedicated"
        self._sleep, self._cpu, self._wall = sleep, cpu_clock, wall_clock
        self._modules = tuple(sync_modules)
        self.enabled = False
        self.slept_s = 0.0
        """Seconds slept so far (the emulated extra compute)."""
        self.passes_s = 0.0
        """Wall seconds of the stretched block passes so far, forward and backward, sleeps and
        collective waits included: what the stage's blocks cost at its emulated speed."""
        self.passes = 0
        """Stretched block passes so far (a block's forward and its backward count one each)."""
        self.intervals = 0
        """Compute intervals stretched so far (one per pass, plus one per collective in it)."""
        self.cpu_s = 0.0
        """The intervals' thread CPU seconds so far."""
        self.compute_wall_s = 0.0
        """The intervals' wall seconds so far, before their sleeps: over ``cpu_s``, how much
        the host's contention slows a core (``dedicated`` absorbs up to ``base``)."""
        self.work_s = 0.0
        """The CPU seconds the intervals were stretched by: ``cpu_s``, or with
        ``median_work`` each interval's median so far."""
        self._pass: tuple[float, Clocks] | None = None
        """The open pass: its start (wall) and its running interval's start clocks."""
        self._pass_key: PassKey | None = None
        """The open pass's block and direction (None: a pass opened by hand, never floored)."""
        self._position = 0
        """The running interval's position in the open pass."""
        self._serials: dict[WorkSignature, int] = {}
        """Per kind of block work attached so far (:func:`work_signature`), its serial: every
        block of one kind shares its samples, whichever variant's model holds it."""
        self._saved: dict[tuple[int, str], Any] = {}
        self._wrappers: dict[int, tuple[Any, Callable[..., Any]]] = {}
        """While a ``dedicated`` pass is open: (module index, name) -> the function wrapped."""
        self._handles: list[Any] = []

    def set_device(self, factor: float, base: float) -> None:
        """Emulate another device from the next interval on: ``1 / factor`` of the speed of one
        ``base`` times slower than a core (``base``: ``dedicated`` mode only). Another device
        starts ``median_work``'s samples afresh: the same ops take the host more CPU time when
        the thread sleeps longer between them (phase (c)'s devices: 14% more per block pass
        than phase (a)'s, session 21), so a variant that ran before would carry the old
        device's cheaper samples into the new one's median, and one built for it would not."""
        if factor < 1.0 or base < 1.0:
            raise ValueError(f"factor, base: a stretch slows down, need >= 1, got {factor}, {base}")
        if (factor, base) != (self.factor, self.base):
            self._samples.clear()
        self.factor, self.base = factor, base

    def clocks(self) -> Clocks:
        """(wall, thread CPU) now: where an interval starts."""
        return self._wall(), self._cpu()

    def extra_s(self, wall: float, cpu: float) -> float:
        """Seconds to sleep after a compute interval of ``wall`` seconds and ``cpu`` seconds of
        the thread's CPU time, as the mode says."""
        if self.mode == "dedicated":
            work = self.base * cpu  # the interval's compute on a full-speed device
            return max(0.0, work - wall) + (self.factor - 1.0) * work
        return (self.factor - 1.0) * wall

    def _settle(self, start: Clocks) -> None:
        wall, cpu = self._wall() - start[0], self._cpu() - start[1]
        self.cpu_s += cpu
        self.compute_wall_s += wall
        work = self._median_cpu(cpu)
        self.work_s += work
        extra = self.extra_s(wall, work)
        if extra > 0.0:
            self.slept_s += extra
            self._sleep(extra)
        self.intervals += 1

    def _median_cpu(self, cpu: float) -> float:
        """The CPU seconds to stretch the running interval by (``median_work``: the median of
        its key's so far, this one included), and move to the next position in the pass."""
        position, self._position = self._position, self._position + 1
        if not self.median_work or self._pass_key is None:
            return cpu
        samples = self._samples.setdefault((*self._pass_key, position), [])
        bisect.insort(samples, cpu)
        middle = len(samples) // 2
        if len(samples) % 2:
            return samples[middle]
        return 0.5 * (samples[middle - 1] + samples[middle])

    @property
    def in_pass(self) -> bool:
        """Whether a block pass is open (its collectives end intervals)."""
        return self._pass is not None

    def begin_pass(self, key: PassKey | None = None) -> None:
        """Start a block pass (no-op while disabled); ends one still open first. ``key``:
        the block's serial and whether the pass is its backward (``median_work``'s key)."""
        if not self.enabled:
            return
        if self._pass is not None:
            self.end_pass()
        self._pass_key, self._position = key, 0
        self._pass = (self._wall(), self.clocks())
        if self.mode == "dedicated":
            self._wrap_syncs()

    def end_pass(self) -> None:
        """Stretch the open pass's last interval and count the pass (no-op when none)."""
        if self._pass is None:
            return
        started, interval = self._pass
        self._unwrap_syncs()
        self._pass = None
        self._settle(interval)
        self.passes_s += self._wall() - started
        self.passes += 1

    def sync(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a collective inside the open pass: stretch the interval up to it, call, start
        the next interval when it returns (an async call's work: when its ``wait()`` does)."""
        if self._pass is None:
            return call(*args, **kwargs)
        self._settle(self._pass[1])
        try:
            result = call(*args, **kwargs)
        finally:
            self._restart()
        if result is not None and callable(getattr(result, "wait", None)):
            return _StretchedWork(self, result)
        return result

    def _restart(self) -> None:
        if self._pass is not None:
            self._pass = (self._pass[0], self.clocks())

    def _wrap_syncs(self) -> None:
        for index, module in enumerate(self._modules):
            for name in SYNC_NAMES:
                original = getattr(module, name, None)
                if original is None:
                    continue
                # One wrapper per distinct function, made once (the cache holds the function,
                # so its id stays its own); a pass then costs a few attribute writes.
                cached = self._wrappers.get(id(original))
                if cached is None or cached[0] is not original:
                    cached = self._wrappers[id(original)] = (original, self._wrap(original))
                self._saved[(index, name)] = original
                setattr(module, name, cached[1])

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def synced(*args: Any, **kwargs: Any) -> Any:
            return self.sync(original, *args, **kwargs)

        return synced

    def _unwrap_syncs(self) -> None:
        for (index, name), original in self._saved.items():
            setattr(self._modules[index], name, original)
        self._saved.clear()

    def attach(self, blocks: Iterable[nn.Module]) -> None:
        """Stretch every block in ``blocks`` (its first positional input is the hidden state)."""
        for block in blocks:
            signature = work_signature(block)
            serial = self._serials.setdefault(signature, len(self._serials))
            block._stretch_serial = serial  # type: ignore[assignment]
            self._handles.append(block.register_forward_pre_hook(self._before, with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._after))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        module._stretch_closes = False  # type: ignore[assignment]
        if not self.enabled:
            return None
        self.begin_pass((module._stretch_serial, False))
        if not args or not torch.is_tensor(args[0]) or not args[0].requires_grad:
            return None
        module._stretch_closes = True  # type: ignore[assignment]
        return (_Mark.apply(args[0], self, True, None), *args[1:]), kwargs

    def _after(self, module: nn.Module, args: tuple, output: Any) -> Any:
        self.end_pass()
        if not self.enabled or not getattr(module, "_stretch_closes", False):
            return None  # no end mark on the input: the backward would never be closed
        if not isinstance(output, tuple) or not torch.is_tensor(output[0]):
            return None
        if not output[0].requires_grad:
            return None
        key = (module._stretch_serial, True)
        return (_Mark.apply(output[0], self, False, key), *output[1:])


def work_signature(block: nn.Module) -> WorkSignature:
    """What a block computes, as far as its cost goes: every submodule's name, class and own
    parameters' shapes. Blocks of the same signature run the same ops on the same shapes (one
    layout: its micro-batch shape is fixed), whichever model copy holds them."""
    return tuple(
        (name, type(module).__name__, tuple(tuple(p.shape) for p in module.parameters(False)))
        for name, module in block.named_modules()
    )


class _StretchedWork:
    """An async collective's work inside a pass: ``wait()`` ends the interval before it and
    starts the next when it returns; everything else is the real work's."""

    def __init__(self, stretch: Stretch, work: Any) -> None:
        self._stretch, self._work = stretch, work

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._stretch.sync(self._work.wait, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _Mark(torch.autograd.Function):
    """Identity; its backward starts (``closes=False``; the pass's ``key``) or ends (``True``)
    one block's backward pass."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, stretch: Stretch, closes: bool, key: PassKey | None
    ) -> torch.Tensor:
        ctx.stretch, ctx.closes, ctx.key = stretch, closes, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        stretch: Stretch = ctx.stretch
        if ctx.closes:
            stretch.end_pass()
        else:
            stretch.begin_pass(ctx.key)
        return grad, None, None, None
