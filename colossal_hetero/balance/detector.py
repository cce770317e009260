"""Straggler detection, pure: agreed per-rank compute times in, a slowdown vector out.

No torch, no torch.distributed, no clock. The runtime half (balance/agree.py) hands every rank
the same window of measurements, so every rank's detector steps through the same states.

Model. Each rank ``i`` of a tensor-parallel group reports its recent per-step compute time
(``StepTiming.compute_time``: the step minus its waits inside collectives, so a fast rank
waiting for a slow one is not counted as slow). Work is assumed proportional to the rank's
work ``w_i`` (``work_units``: its share of the widths, plus a part that does not scale with
them), so ``u_i = median(window_i) / w_i`` is its time per unit of work:
its device's slowness, whatever widths it runs now. Across windows ``u_i`` is smoothed by an
EWMA, except that a reading over ``1 + 2 * threshold`` times the smoothed one (either way)
replaces it; the slowdown vector is ``s_i = u_i / min_j u_j`` (the fastest rank is 1.0).

Hysteresis. A rank is flagged when ``s_i > 1 + threshold`` and released only when
``s_i < 1 + release`` (release < threshold), so a rank hovering near the threshold does not
flap. A flagged rank whose slowdown fell by more than ``1 + 2 * threshold`` since the last
agreement (a *sudden* recovery, not a hover) is released below ``1 + threshold`` already.
The vector is *stable since* the last agreement at which the flagged set changed or
any ``s_i`` moved by more than ``stable_tolerance`` (relative) from the vector held then.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from colossal_hetero.planner.plan import WIDTH_KEY_OF_KIND

MIN_SHARE = 1e-3
"""Smallest share of the work a rank is assumed to carry (for time per unit of work)."""


@dataclass(frozen=True, slots=True)
class Detection:
    """The detector's state after one agreement."""

    step: int
    """The step the agreement followed."""

    slowdown: tuple[float, ...]
    """Per rank of the group, smoothed time per unit of work over the fastest rank's (>= 1)."""

    stragglers: tuple[int, ...]
    """Flagged ranks (indices into ``slowdown``), ascending."""

    stable_since: int
    """The step since which the flagged set and the vector (within tolerance) held."""

    def stable_for(self) -> int:
        """Steps the vector has been stable, counted to ``step``."""
        return self.step - self.stable_since

    @property
    def speeds(self) -> tuple[float, ...]:
        """Relative speeds (fastest 1.0): ``1 / slowdown``."""
        return tuple(1.0 / s for s in self.slowdown)


@dataclass(frozen=True, slots=True)
class DetectorSettings:
    """Knobs of :class:`StragglerDetector` (``config.schema.BalancerConfig`` carries them)."""

    smoothing: float = 0.5
    threshold: float = 0.15
    release: float = 0.05
    stable_tolerance: float = 0.1


class StragglerDetector:
    """EWMA of per-unit compute time, slowdown normalised to the fastest rank, hysteresis.

    Args:
        size: ranks in the group.
        settings: smoothing, thresholds and stability tolerance.
    """

    def __init__(self, size: int, settings: DetectorSettings) -> None:
        assert size >= 1 and 0 <= settings.release < settings.threshold
        self.size, self.settings = size, settings
        self._ewma: list[float] | None = None
        self._flagged: frozenset[int] = frozenset()
        self._reference: tuple[float, ...] | None = None
        self._stable_since = 0
        self._last: tuple[float, ...] | None = None  # the slowdown at the last agreement
        self._loaded: frozenset[int] | None = None  # the ranks read against (None: all)
        self._scale: dict[int, float] = {}  # per-unit rescaling of rebased ranks

    def reset(self, step: int) -> None:
        """Forget the smoothed times (after a move their shares changed), the last slowdown
        and any rebasing; flags are kept and stability restarts at ``step``."""
        self._ewma, self._reference, self._stable_since = None, None, step
        self._last, self._scale = None, {}

    def update(
        self,
        step: int,
        window: Sequence[Sequence[float]],
        shares: Sequence[float],
        loaded: Collection[int] | None = None,
    ) -> Detection:
        """Fold one agreed window in and return the new state.

        Args:
            step: the step the window ends at.
            window: per rank, its recent compute times in seconds (any non-empty length).
            shares: per rank, its amount of work, any positive scale (e.g. ``work_units``).
            loaded: the ranks to read the others against (None or none given: every rank).
                The slowdown is over the fastest of them, and a rank outside them reads at
                least 1: a rank near no scaling work runs its fixed part alone, whose
                per-unit time carries the fitted fixed fraction's error, so it may read the
                fastest of all and every loaded rank slow against it (session 10: a run
                under load read a recovered 4x rank with no heads fastest and flagged two
                equal ranks at 1.26-1.34 against it, so no re-plan came in the phase).
        """
        self._loaded = frozenset(loaded) if loaded else None
        assert len(window) == len(shares) == self.size
        # A rank given no width still runs the replicated layers: floor its share.
        unit = [
            statistics.median(times) / max(share, MIN_SHARE) * self._scale.get(rank, 1.0)
            for rank, (times, share) in enumerate(zip(window, shares, strict=True))
        ]
        if self._ewma is None:
            self._ewma = unit
        else:
            self._ewma = [self._smooth(old, new) for old, new in zip(self._ewma, unit, strict=True)]
        slowdown = self._slowdown()
        last, limit = self._last, sudden(self.settings)
        dropped = {r for r in self._flagged if last is not None and last[r] > limit * slowdown[r]}
        flagged = frozenset(flag_stragglers(slowdown, self._flagged - dropped, self.settings))
        return self._settle(step, slowdown, flagged)

    def rebase(self, step: int, ranks: Collection[int]) -> Detection:
        """Release ``ranks`` and read them from now on as fast as the fastest other rank,
        until the next ``reset``: their later per-unit times are scaled by the factor that
        makes the present one the fastest's, so only a change of their times counts.

        For a rank near no scaling work, whose per-unit time is its fixed part over the
        fitted fixed fraction (so its level carries the fit's error), and which the caller
        judged recovered from a drop of its readings at the same widths
        (``balance.recovery``): its level would otherwise keep it flagged, or flag it again
        at the next agreement."""
        assert self._ewma is not None and self._last is not None
        pool = self._loaded or range(self.size)
        for rank in ranks:
            others = [u for r, u in enumerate(self._ewma) if r != rank and r in pool]
            fastest = min(others) if others else self._ewma[rank]
            self._scale[rank] = self._scale.get(rank, 1.0) * fastest / self._ewma[rank]
            self._ewma[rank] = fastest
        return self._settle(step, self._slowdown(), self._flagged - frozenset(ranks))

    def _slowdown(self) -> tuple[float, ...]:
        assert self._ewma is not None
        pool = self._loaded or range(self.size)
        fastest = min(u for r, u in enumerate(self._ewma) if r in pool)
        return tuple(max(u / fastest, 1.0) if fastest > 0 else 1.0 for u in self._ewma)

    def _settle(self, step: int, slowdown: tuple[float, ...], flagged: frozenset[int]) -> Detection:
        """Keep the new flags and vector; stability restarts where either changed."""
        if flagged != self._flagged or not _close(slowdown, self._reference, self.settings):
            self._reference, self._stable_since = slowdown, step
        self._flagged, self._last = flagged, slowdown
        return Detection(step, slowdown, tuple(sorted(flagged)), self._stable_since)

    def _smooth(self, old: float, new: float) -> float:
        """The EWMA step, or the new reading alone when it is over ``1 + 2 * threshold``
        times the old one either way (``sudden``): a change that large is no timing noise
        (the window's median has already filtered single steps), and smoothing it only delays
        the flag or the release (with smoothing 0.5 an 8x rank's recovery took four more
        agreements to fall below a 1.5x release)."""
        if old > 0 and new > 0 and max(new / old, old / new) > sudden(self.settings):
            return new
        alpha = self.settings.smoothing
        return (1 - alpha) * old + alpha * new


def sudden(settings: DetectorSettings) -> float:
    """The ratio of a rank's new per-unit time to its smoothed one beyond which the detector
    takes the new reading unsmoothed: ``1 + 2 * threshold``."""
    return 1 + 2 * settings.threshold


def flag_stragglers(
    slowdown: Sequence[float], flagged: frozenset[int], settings: DetectorSettings
) -> list[int]:
    """Ranks flagged after hysteresis: newly above ``1 + threshold``, or flagged before and
    not yet below ``1 + release``."""
    out = []
    for rank, s in enumerate(slowdown):
        limit = 1 + (settings.release if rank in flagged else settings.threshold)
        if (s >= limit) if rank in flagged else (s > limit):
            out.append(rank)
    return out


def _close(
    new: Sequence[float], reference: Sequence[float] | None, settings: DetectorSettings
) -> bool:
    if reference is None:
        return False
    tolerance = settings.stable_tolerance
    return all(abs(a - b) <= tolerance * b for a, b in zip(new, reference, strict=True))


def work_units(shares: Sequence[float], fixed_fraction: float) -> tuple[float, ...]:
    """Per rank, its work relative to an even split: ``phi + (1 - phi) * n * share`` with
    ``phi = fixed_fraction`` the part of the work that does not scale with the widths."""
    n = len(shares)
    return tuple(fixed_fraction + (1 - fixed_fraction) * n * share for share in shares)


def shares_of(
    widths: Mapping[str, Sequence[int]],
    size: int,
    compute: Mapping[str, float] | None = None,
) -> tuple[float, ...]:
    """Per rank, its share of the work: its fraction of each width key's total, weighted by
    the key's compute (``compute[key]``: FLOPs of every layer the key sizes, any common scale,
    e.g. :func:`width_key_compute`; a key missing from it weighs 0). Without ``compute`` every
    key weighs the same. Keys whose total is 0 are skipped; nothing left: even shares."""
    weighted = [
        (1.0 if compute is None else compute.get(key, 0.0), [w / sum(counts) for w in counts])
        for key, counts in widths.items()
        if sum(counts) > 0
    ]
    total = sum(weight for weight, _ in weighted)
    if total <= 0:
        return tuple(1.0 / size for _ in range(size))
    return tuple(sum(weight * f[i] for weight, f in weighted) / total for i in range(size))


def width_key_compute(layers: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Per width key, the forward FLOPs per sample of the layers it sizes.

    Args:
        layers: per layer, its kind (a ``LayerKind`` value) and its forward FLOPs per sample
            (``flops_per_token * tokens`` of ``planner.spec.LayerSpec``); kinds no width key
            sizes (norms, replicated linears) are left out.
    """
    out: dict[str, float] = {}
    for kind, flops in layers:
        key = WIDTH_KEY_OF_KIND.get(kind)
        if key is not None:
            out[key] = out.get(key, 0.0) + flops
    return out


MIN_SHARE_CHANGE = 0.25
"""Smallest change of a rank's even-split work (``n * share``) across a move for its times to
say anything about the fixed fraction (smaller changes drown in timing noise)."""


ESTIMATE_BAND = (-0.5, 1.5)
"""A rank's fixed-fraction estimate beyond half a unit outside ``[0, 1]`` is left out: its
time ratio lies well outside the range any ``phi`` explains (timing noise of a few percent
moves an estimate by about that over its share change, at least 0.25: 0.1 to 0.2)."""


def fixed_fraction_from_move(
    before: Sequence[float],
    old_shares: Sequence[float],
    after: Sequence[float],
    new_shares: Sequence[float],
    steady: float = math.inf,
    only: Collection[int] | None = None,
) -> float | None:
    """The fixed fraction ``phi`` that explains a move's measured times, or None.

    A rank's device keeps its speed ``v_i`` across the move, so with ``a = n * old_share``
    and ``b = n * new_share`` its times are ``v (phi + (1 - phi) a)`` before and
    ``v (phi + (1 - phi) b)`` after; their ratio ``r`` gives
    ``phi = (b - r a) / ((b - 1) - r (a - 1))``. Each rank whose ``|b - a|`` is at least
    ``MIN_SHARE_CHANGE`` gives one estimate, clipped to ``[0, 0.9]``, unless it lies beyond
    ``ESTIMATE_BAND`` (since session 10; before, it was clipped too: a run under load 11-21
    read 0.9 from one rank whose time grew as its work shrank, and planned a 2x rank out of
    work); the result is their median (None when no rank gives one).

    ``steady``: whatever ``phi`` in [0, 1], a rank's time ratio lies between 1 and its work's
    ratio ``b / a``; a rank beyond that range by more than ``steady`` times (either way)
    changed speed across the move (a straggler began or ended in the window), and then no
    rank's times say anything about ``phi``: None. (Bench runs: a move one step before a 4x
    phase read 0.9; an 8x rank resized at the agreement its slowdown began took 1.9x longer
    for half its GEMM work, read 0.9.)

    ``only``: the ranks that give estimates (all when None); the check covers every rank.
    """
    n = len(before)
    assert len(old_shares) == len(after) == len(new_shares) == n
    estimates = []
    for rank, (t0, s0, t1, s1) in enumerate(
        zip(before, old_shares, after, new_shares, strict=True)
    ):
        a, b = n * s0, n * s1
        if t0 <= 0 or t1 <= 0:
            continue
        work = b / a if a > 0 else math.inf
        if not min(1.0, work) / steady <= t1 / t0 <= max(1.0, work) * steady:
            return None
        if abs(b - a) < MIN_SHARE_CHANGE or (only is not None and rank not in only):
            continue
        r = t1 / t0
        denominator = (b - 1) - r * (a - 1)
        if abs(denominator) < 1e-12:
            continue
        estimate = (b - r * a) / denominator
        if ESTIMATE_BAND[0] <= estimate <= ESTIMATE_BAND[1]:
            estimates.append(min(max(estimate, 0.0), 0.9))
    return statistics.median(estimates) if estimates else None
