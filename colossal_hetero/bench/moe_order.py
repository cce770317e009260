"""``bench moe``'s variant order: variants of one model lead their group equally often.

Our EP=2 x DP=2 variants without pipelining or packing (``TWINS``: priority off, hold, gap
fitting, all on, session 7's all on) train the same model on the same batches, so in a round
their experts receive the same token counts: the same matrix shapes, new in every round. On
CPU, oneDNN compiles bf16 matmul kernels for each new shape (one expert's forward and
backward: 3.1 ms of CPU for a new token count, 1.0 ms once cached), and the cache is the
process's: the first of the twins to run in a round compiled that round's expert kernels for
the others. It took 10-13 ms more CPU
(20-35 ms more step, on the emulated device that stretches CPU time 2.5x) than the same
variant in a round where another twin ran first (docs/moe.md, session 11). The rounds'
Williams order (bench/rounds.py) balances positions and neighbours, not which twin comes
first among them: with the variants in their declared order all on came first in 9 of 22
rounds and hold in 2, so all on ran 5-7% behind hold with the same code.

:func:`balanced_order` re-orders the variants (their dict order is the rounds' name order) so
that each member of a group comes first among it as evenly as the rounds allow, over the
measured rounds of a full Williams cycle. Pure.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from itertools import combinations

from colossal_hetero.bench.rounds import round_order

TWINS = ("ours_off", "ours_hold", "ours_on", "ours_all", "ours_s7")
"""Variants of ours with the same model, routing and expert shapes in every round."""


def first_counts(names: Sequence[str], group: Sequence[str], rounds: range) -> dict[str, int]:
    """How often each member of ``group`` runs first among it in ``rounds`` of the rounds'
    order of ``names``."""
    counts = dict.fromkeys(group, 0)
    members = set(group)
    for index in rounds:
        counts[next(n for n in round_order(list(names), index) if n in members)] += 1
    return counts


def balanced_order(names: Sequence[str], group: Sequence[str], warmup: int) -> list[str]:
    """``names`` re-ordered so that the members of ``group`` (those in ``names``) come first
    among it equally often over the measured rounds ``warmup .. warmup + 2n``: the least
    max-min spread at the cycle's end, then the least spread summed over its prefixes (a
    run that stops early), then the earliest positions; members keep their relative order,
    and so do the others."""
    members = [n for n in names if n in set(group)]
    others = [n for n in names if n not in set(group)]
    if len(members) < 2:
        return list(names)
    n = len(names)
    best: tuple[int, int, tuple[int, ...]] | None = None
    for spots in combinations(range(n), len(members)):
        order = _placed(members, others, spots, n)
        counts = dict.fromkeys(members, 0)
        spread_sum = 0
        for index in range(warmup, warmup + 2 * n):
            row = round_order(order, index)
            counts[next(x for x in row if x in counts)] += 1
            spread_sum += max(counts.values()) - min(counts.values())
        key = (max(counts.values()) - min(counts.values()), spread_sum, spots)
        if best is None or key < best:
            best = key
    assert best is not None
    return _placed(members, others, best[2], n)


def _placed(members: list[str], others: list[str], spots: tuple[int, ...], n: int) -> list[str]:
    """``members`` at positions ``spots``, ``others`` in the rest, each in its own order."""
    at = dict(zip(spots, members, strict=True))
    rest = iter(others)
    return [at[i] if i in at else next(rest) for i in range(n)]


def twin_leads(
    names: Sequence[str], group: Sequence[str], series: dict[str, list[float]], warmup: int
) -> dict[str, dict[str, float | int | None]]:
    """Per member of ``group`` that ran: the measured rounds it led the group in (the rounds'
    order of ``names``, first measured round ``warmup``), and the median of its ``step`` and
    ``cpu`` series in those rounds and in the others (None where there are none)."""
    members = [n for n in names if n in set(group) and f"{n}.step" in series]
    rounds = len(series[f"{members[0]}.step"]) if members else 0
    led = {n: [False] * rounds for n in members}
    for i in range(rounds):
        row = round_order(list(names), warmup + i)
        led[next(x for x in row if x in led)][i] = True
    out: dict[str, dict[str, float | int | None]] = {}
    for name in members:
        entry: dict[str, float | int | None] = {"led": sum(led[name])}
        for key in ("step", "cpu"):
            values = series.get(f"{name}.{key}") or [float("nan")] * rounds
            for flag, label in ((True, "led"), (False, "not_led")):
                chosen = [v for v, m in zip(values, led[name], strict=True) if m == flag]
                chosen = [v for v in chosen if v == v]  # NaN: no such series
                entry[f"{key}_{label}"] = statistics.median(chosen) if chosen else None
        out[name] = entry
    return out
