"""``bench moe``'s priming: every timed step runs with the round's kernels already compiled.

On CPU, oneDNN compiles bf16 matmul kernels for each new matrix shape and caches them in the
process (one Mixtral expert's forward and backward: 3.1 ms of CPU for a new token count,
1.0 ms cached; docs/moe.md, session 11). A round's batch gives every expert a new token count,
so the first step of a round on some expert shapes pays the compile. Our same-model variants
(bench/moe_order.py's twins) share their shapes, so only the first of them in a round paid it;
the stock plugin and DeepSpeed-MoE have routings of their own and paid it in every round. In
steady-state training every common shape is cached for everyone.

:func:`primed` makes each measured round of a variant two steps on the round's own batch:
first an untimed *priming* step with every learning rate at 0 (:func:`frozen_lr`), which runs
the variant's whole step (forward, a2a's, backward, gradient reduction, optimizer step) on the
same weights, so it meets exactly the shapes of the timed step and compiles them; then the
timed step. With AdamW at lr 0 the weights (and fp32 master weights) stay bit-identical; the
optimizer's moments and step count see the round's gradient twice, alike for every variant.
The first measured round checks that the weights did not change (RuntimeError otherwise).
The priming step's time, CPU and page faults go into the round's series as ``prime_step``,
``prime_cpu`` and ``prime_faults`` (never into a ratio). Warm-up rounds are not primed.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

PRIMED = ("step", "cpu", "faults")
"""Values of the priming step kept in the series (as ``prime_<name>``)."""

DESCRIPTION = (
    "before each measured round's timed step, every variant runs one untimed priming step on "
    "the round's batch with learning rate 0 (same weights, so the same expert shapes: oneDNN's "
    "bf16 kernels for them are compiled there and cached for the timed step, as in steady-state "
    "training); prime_step/prime_cpu/prime_faults in the series, outside every ratio"
)


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside ``optimizer`` (a Colossal-AI wrapper's ``optim``, a
    DeepSpeed optimizer's ``optimizer``, or ``optimizer`` itself)."""
    seen = optimizer
    for _ in range(8):
        if isinstance(seen, torch.optim.Optimizer):
            return seen
        seen = getattr(seen, "optim", None) or getattr(seen, "optimizer", None)
        if seen is None:
            break
    raise TypeError(f"no torch optimizer inside {type(optimizer).__name__}")


@contextmanager
def frozen_lr(optimizer: Any) -> Iterator[None]:
    """Every parameter group's learning rate 0 within the block, restored after (an error
    included)."""
    groups = inner_optimizer(optimizer).param_groups
    saved = [group["lr"] for group in groups]
    for group in groups:
        group["lr"] = 0.0
    try:
        yield
    finally:
        for group, lr in zip(groups, saved, strict=True):
            group["lr"] = lr


def primed(
    run: Callable[..., Mapping[str, float]],
    optimizer: Any,
    parameters: Callable[[], Iterable[torch.nn.Parameter]],
) -> Callable[..., dict[str, float]]:
    """``run`` (a round entry, ``run(index, warmup=...)``) with a priming step before each
    measured step (see the module); ``optimizer`` is the one ``run`` steps, ``parameters`` gives
    the weights the first priming must leave unchanged."""
    checked = [False]

    def step(index: int, *, warmup: bool) -> dict[str, float]:
        if warmup:
            return dict(run(index, warmup=True))
        before = None if checked[0] else [p.detach().clone() for p in parameters()]
        with frozen_lr(optimizer):
            first = run(index, warmup=True)  # untimed: no step log kept
        if before is not None:
            after = list(parameters())
            if len(after) != len(before) or not all(
                torch.equal(b, a.detach()) for b, a in zip(before, after, strict=True)
            ):
                raise RuntimeError("bench moe: the priming step (lr 0) changed the weights")
            checked[0] = True
        values = dict(run(index, warmup=False))
        values.update({f"prime_{k}": float(first[k]) for k in PRIMED if k in first})
        return values

    return step


def minor_faults() -> float:
    """This thread's minor page faults so far (Linux ``RUSAGE_THREAD``)."""
    return float(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)


def with_cpu(
    scope: Callable[[int], AbstractContextManager[dict[str, float]]],
) -> Callable[[int], AbstractContextManager[dict[str, float]]]:
    """``scope`` whose yielded dict also gets the block's thread CPU seconds (``cpu``) and
    minor page faults (``faults``), as ``bench moe`` measures the stock step's."""

    @contextmanager
    def measured(index: int) -> Iterator[dict[str, float]]:
        cpu, faults = time.thread_time(), minor_faults()
        with scope(index) as seen:
            yield seen
        seen.update(cpu=time.thread_time() - cpu, faults=minor_faults() - faults)

    return measured


def priming_summary(series: Mapping[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per variant with priming series: the medians over measured rounds of the priming step's
    time, CPU and page faults, and of the timed step's (``cpu``/``faults`` where measured)."""
    names = sorted({k.rsplit(".", 1)[0] for k in series if k.endswith(".prime_step")})
    out: dict[str, dict[str, float]] = {}
    for name in names:
        entry: dict[str, float] = {}
        for key in PRIMED:
            for label, field in (("prime", f"prime_{key}"), ("timed", key)):
                values = series.get(f"{name}.{field}")
                if values:
                    entry[f"{label}_{key}"] = statistics.median(values)
        out[name] = entry
    return out
