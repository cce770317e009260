"""One wrapper layer over torch.distributed's collectives, shared by every interceptor.

Several plugins may live in one process, one after another or side by side (a script that
compares two layouts, the benchmark's interleaved variants). Each has its own
``CollectiveInterceptor`` (its own step accounting and emulation), but the collectives they
intercept are process-wide functions: wrapping them once per interceptor would nest the
wrappers, and a call would then be stretched, timed and delayed twice.

So the functions are wrapped once, by a ``CollectiveRouter``, and each wrapped call is
dispatched to the one interceptor that has a step open in the calling thread (or runs
unchanged when none has). Interceptors attach to the router on ``install`` and detach on
``uninstall``; the wrappers come off with the last one (a reference count: the list of
attached interceptors).

Why the router is found through the wrappers rather than held in a variable: the patched
functions on ``torch.distributed`` are process-wide state that interception cannot avoid. Each
wrapper carries its router, so ``CollectiveRouter.shared()`` reads the router off the function
currently installed; there is no second record (a module-level registry, or an object parked
on torch's module) that could disagree with what is really installed, and nothing remains
once the wrappers are gone. Each plugin holds its interceptor, and each interceptor holds the
router it attached to, explicitly.

Rules the router enforces:
- at most one interceptor has a step open per thread: a call belongs to exactly one step;
- interceptors that emulate must emulate the same cluster (``compatible``): a process pretends
  to be one machine, so a second plugin that declares another slowdown or another network for
  this rank is refused with a ``ValueError`` when it installs, which the plugin does before it
  creates any process group. A part that is off claims nothing and fits beside any (a
  timing-only interceptor; the benchmark's baseline, which keeps the links but not the
  slowdowns).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from colossal_hetero.emulation.collectives import WRAPPED_NAMES

if TYPE_CHECKING:
    from colossal_hetero.emulation.interceptor import CollectiveInterceptor

# Colossal-AI calls `dist.X` at call time, and torch's own helpers (all_gather_object calling
# all_gather) resolve names in distributed_c10d: both modules must see the wrappers.
MODULES: tuple[ModuleType, ...] = (dist, c10d)
_ROUTER_ATTR = "_colossal_hetero_router"  # the attribute of a wrapper naming its router


class CollectiveRouter:
    """The wrappers on ``torch.distributed`` and the interceptors they dispatch to."""

    def __init__(self) -> None:
        self._originals: dict[tuple[ModuleType, str], Callable[..., Any]] = {}
        self._attached: list[CollectiveInterceptor] = []

    @classmethod
    def shared(cls) -> CollectiveRouter:
        """The router whose wrappers are installed now, or a new one (not yet installed)."""
        router = getattr(getattr(MODULES[0], WRAPPED_NAMES[0]), _ROUTER_ATTR, None)
        return router if isinstance(router, CollectiveRouter) else cls()

    @property
    def installed(self) -> bool:
        """Whether this router's wrappers are on torch.distributed."""
        return bool(self._originals)

    @property
    def attached(self) -> tuple[CollectiveInterceptor, ...]:
        """The interceptors attached now, in attach order."""
        return tuple(self._attached)

    def originals(self) -> dict[str, Callable[..., Any]]:
        """Wrapped name -> the original function it calls (one per distinct original)."""
        return {name: fn for (_, name), fn in self._originals.items()}

    def attach(self, interceptor: CollectiveInterceptor) -> None:
        """Route calls to ``interceptor`` while it has a step open; wraps on the first attach.

        Raises:
            RuntimeError: ``interceptor`` is attached already.
            ValueError: it emulates differently from one attached already (the message
                names ``emulation.compute`` or ``emulation.network``).
        """
        if any(other is interceptor for other in self._attached):
            raise RuntimeError("this CollectiveInterceptor is already installed")
        for other in self._attached:
            reason = compatible(interceptor, other)
            if reason is not None:
                raise ValueError(
                    f"{reason}; the plugins of one process rehearse one cluster, so give "
                    "them the same emulation or none"
                )
        if not self._attached:
            self._install()
        self._attached.append(interceptor)

    def detach(self, interceptor: CollectiveInterceptor) -> None:
        """Stop routing to ``interceptor``; the last detach restores the exact originals."""
        self._attached = [other for other in self._attached if other is not interceptor]
        if not self._attached:
            for (module, name), original in self._originals.items():
                setattr(module, name, original)
            self._originals.clear()

    def check_free(self, interceptor: CollectiveInterceptor) -> None:
        """Raise unless no other interceptor has a step open in the calling thread."""
        busy = self._target()
        if busy is not None and busy is not interceptor:
            raise RuntimeError(
                "a step opened while another plugin's step is open in this thread; run one "
                "plugin's step (forward ... optimizer.step()) at a time"
            )

    def _target(self) -> CollectiveInterceptor | None:
        """The attached interceptor with a step open in the calling thread, if any."""
        for interceptor in self._attached:
            if interceptor.stepping_here():
                return interceptor
        return None

    def _install(self) -> None:
        wrappers: dict[int, Callable[..., Any]] = {}  # one wrapper per distinct original
        for module in MODULES:
            for name in WRAPPED_NAMES:
                original = getattr(module, name)
                if id(original) not in wrappers:
                    wrappers[id(original)] = self._wrap(name, original)
                self._originals[(module, name)] = original
                setattr(module, name, wrappers[id(original)])

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def routed(*args: Any, **kwargs: Any) -> Any:
            target = self._target()
            if target is None:
                return original(*args, **kwargs)
            return target.intercept(name, original, args, kwargs)

        setattr(routed, _ROUTER_ATTR, self)
        return routed


def flush_compute() -> None:
    """Apply the emulated slowdown to the calling thread's compute so far, now
    (``CollectiveInterceptor.flush_compute`` of the interceptor whose step is open here; a
    no-op when none is)."""
    target = CollectiveRouter.shared()._target()
    if target is not None:
        target.flush_compute()


def compatible(a: CollectiveInterceptor, b: CollectiveInterceptor) -> str | None:
    """None if ``a`` and ``b`` may be attached together, else why not (one phrase).

    Each part of an emulation, the compute slowdowns and the network, either is off (it
    claims nothing: the host as it is, as a benchmark's baseline measures it) or describes the
    cluster; two parts that are on must be equal. The parts compared are the whole world's
    configs where both interceptors know them (``build_interceptor`` records them), so that
    every rank reaches the same verdict; else this rank's models.
    """
    claims_a, claims_b = _claims(a, b), _claims(b, a)
    for part, mine, theirs in zip(("compute", "network"), claims_a, claims_b, strict=True):
        if mine is not None and theirs is not None and mine != theirs:
            return f"emulation.{part}: differs from another plugin's in this process"
    return None


def _claims(interceptor: CollectiveInterceptor, other: CollectiveInterceptor) -> tuple[Any, Any]:
    """(compute, network) as ``interceptor`` emulates them; None for a part that is off."""
    emulation = interceptor.emulation
    if emulation is not None and other.emulation is not None:
        network = emulation.network
        return (tuple(emulation.slowdowns) or None, network if network.enabled else None)
    return interceptor.slowdown, interceptor.network
