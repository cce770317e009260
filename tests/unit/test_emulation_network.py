"""NetworkModel: link lookup, preemption windows and collective formulas, against values
computed by hand. Pure, no processes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from colossal_hetero.config.schema import LinkSpec, NetworkEmulationConfig, PreemptionSpec
from colossal_hetero.emulation import NetworkModel
from colossal_hetero.emulation.collectives import COLLECTIVES, CallArgs, ModelContext
from tests.tolerances import FLOAT64_FORMULA_RTOL

GBPS = 1e9 / 8  # bytes/s per Gbit/s
US = 1e-6


def _model(world_size: int = 4, **net: object) -> NetworkModel:
    return NetworkModel.from_config(NetworkEmulationConfig(**net), world_size)  # type: ignore[arg-type]


# 8 Gbit/s and 10 us everywhere, except a slow 0.8 Gbit/s, 50 us link between ranks 3 and 0.
SLOW_LINK = {
    "bandwidth_gbps": 8.0,
    "latency_us": 10.0,
    "links": [LinkSpec(ranks=[3, 0], bandwidth_gbps=0.8, latency_us=50.0)],
}


def test_disabled_model_costs_nothing() -> None:
    model = _model(latency_us=100.0)  # latency alone does not enable the model
    assert not model.enabled
    assert model.all_reduce_time([0, 1, 2, 3], 10**9, 0) == 0.0
    assert model.p2p_time(0, 1, 10**9, 0) == 0.0
    assert model.barrier_time([0, 1], 0) == 0.0


def test_link_uses_override_else_default_and_is_symmetric() -> None:
    model = _model(**SLOW_LINK)
    assert (
        model.link(0, 3, 0)
        == model.link(3, 0, 0)
        == pytest.approx((0.8 * GBPS, 50 * US), rel=FLOAT64_FORMULA_RTOL)
    )
    assert model.link(1, 2, 0) == pytest.approx((8 * GBPS, 10 * US), rel=FLOAT64_FORMULA_RTOL)
    assert model.link(2, 2, 0) == (math.inf, 0.0)


def test_links_without_default_bandwidth_leave_other_links_free() -> None:
    model = _model(latency_us=5.0, links=[LinkSpec(ranks=[0, 1], bandwidth_gbps=1.0)])
    assert model.enabled
    assert model.p2p_time(1, 2, 10**9, 0) == pytest.approx(5 * US, rel=FLOAT64_FORMULA_RTOL)
    assert model.p2p_time(1, 0, 10**9, 0) == pytest.approx(10**9 / GBPS, rel=FLOAT64_FORMULA_RTOL)


def test_ring_all_reduce_uses_ring_links_of_group_order() -> None:
    model = _model(**SLOW_LINK)
    nbytes = 10**8
    # Ring 0-1-2-3-0 closes over the slow link: 2*3/4 * B / 1e8 B/s + 6 * 50 us.
    assert model.all_reduce_time([0, 1, 2, 3], nbytes, 0) == pytest.approx(
        1.5 + 6 * 50 * US, rel=FLOAT64_FORMULA_RTOL
    )
    # Ring 0-1-3-2-0 avoids it: 2*3/4 * B / 1e9 B/s + 6 * 10 us.
    assert model.all_reduce_time([0, 1, 3, 2], nbytes, 0) == pytest.approx(
        0.15 + 6 * 10 * US, rel=FLOAT64_FORMULA_RTOL
    )


def test_all_gather_and_reduce_scatter_use_the_full_tensor() -> None:
    model = _model(**SLOW_LINK)
    total = 4 * 10**8  # the gathered tensor, or the reduce-scatter input
    expected = 3 / 4 * total / (0.8 * GBPS) + 3 * 50 * US
    assert model.all_gather_time([0, 1, 2, 3], total, 0) == pytest.approx(
        expected, rel=FLOAT64_FORMULA_RTOL
    )
    assert model.reduce_scatter_time([0, 1, 2, 3], total, 0) == pytest.approx(
        expected, rel=FLOAT64_FORMULA_RTOL
    )


def test_all_to_all_uses_every_pair() -> None:
    model = _model(**SLOW_LINK)
    # Order 0-1-3-2 avoids the slow link on the ring, but all-to-all uses every pair.
    expected = 3 / 4 * 10**8 / (0.8 * GBPS) + 3 * 50 * US
    assert model.all_to_all_time([0, 1, 3, 2], 10**8, 0) == pytest.approx(
        expected, rel=FLOAT64_FORMULA_RTOL
    )
    assert model.all_to_all_time([1, 2], 10**8, 0) == pytest.approx(
        0.5 * 0.1 + 10 * US, rel=FLOAT64_FORMULA_RTOL
    )


def test_broadcast_reduce_and_barrier() -> None:
    model = _model(**SLOW_LINK)
    # Three ranks: ceil(log2 3) = 2 latency hops; pair (0, 3) is the slowest.
    expected = 10**8 / (0.8 * GBPS) + 2 * 50 * US
    assert model.broadcast_time([0, 2, 3], 10**8, 0) == pytest.approx(
        expected, rel=FLOAT64_FORMULA_RTOL
    )
    assert model.reduce_time([0, 2, 3], 10**8, 0) == pytest.approx(
        expected, rel=FLOAT64_FORMULA_RTOL
    )
    assert model.broadcast_time([1, 2], 10**8, 0) == pytest.approx(
        0.1 + 10 * US, rel=FLOAT64_FORMULA_RTOL
    )
    assert model.barrier_time([0, 1, 2, 3], 0) == pytest.approx(
        3 * 50 * US, rel=FLOAT64_FORMULA_RTOL
    )


def test_gather_and_scatter_use_the_roots_links() -> None:
    model = _model(**SLOW_LINK)
    total = 3 * 10**8
    fast = 2 / 3 * total / (8 * GBPS) + 2 * 10 * US
    slow = 2 / 3 * total / (0.8 * GBPS) + 2 * 50 * US
    assert model.gather_time([1, 2, 3], 1, total, 0) == pytest.approx(
        fast, rel=FLOAT64_FORMULA_RTOL
    )
    assert model.scatter_time([0, 1, 3], 3, total, 0) == pytest.approx(
        slow, rel=FLOAT64_FORMULA_RTOL
    )


def test_p2p_uses_the_direct_link() -> None:
    model = _model(**SLOW_LINK)
    assert model.p2p_time(0, 3, 10**8, 0) == pytest.approx(1.0 + 50 * US, rel=FLOAT64_FORMULA_RTOL)
    assert model.p2p_time(2, 1, 10**8, 0) == pytest.approx(0.1 + 10 * US, rel=FLOAT64_FORMULA_RTOL)
    assert model.p2p_time(2, 2, 10**8, 0) == 0.0


def test_single_rank_groups_cost_nothing() -> None:
    model = _model(**SLOW_LINK)
    assert model.all_reduce_time([3], 10**9, 0) == 0.0
    assert model.all_gather_time([3], 10**9, 0) == 0.0
    assert model.barrier_time([3], 0) == 0.0


def test_preemption_window_scales_bandwidth_not_latency() -> None:
    window = PreemptionSpec(factor=0.5, start_step=2, end_step=4)
    model = _model(world_size=2, bandwidth_gbps=0.08, latency_us=100.0, preemptions=[window])
    base = 2 * 1 / 2 * 4e5 / 1e7  # 0.08 Gbit/s = 1e7 bytes/s
    latency = 2 * 100 * US
    times = [model.all_reduce_time([0, 1], 400_000, s) for s in (1, 2, 3, 4)]
    assert times == pytest.approx(
        [t + latency for t in (base, 2 * base, 2 * base, base)], rel=FLOAT64_FORMULA_RTOL
    )


def test_preemption_of_listed_ranks_hits_only_their_links() -> None:
    model = _model(bandwidth_gbps=8.0, preemptions=[PreemptionSpec(factor=0.25, ranks=[1])])
    assert model.link(0, 1, 0)[0] == pytest.approx(2 * GBPS, rel=FLOAT64_FORMULA_RTOL)
    assert model.link(1, 3, 0)[0] == pytest.approx(2 * GBPS, rel=FLOAT64_FORMULA_RTOL)
    assert model.link(0, 2, 0)[0] == pytest.approx(8 * GBPS, rel=FLOAT64_FORMULA_RTOL)


def test_overlapping_preemptions_multiply() -> None:
    model = _model(
        bandwidth_gbps=8.0,
        preemptions=[
            PreemptionSpec(factor=0.5),
            PreemptionSpec(factor=0.5, start_step=10, end_step=20, ranks=[2]),
        ],
    )
    assert model.link(2, 3, 9)[0] == pytest.approx(4 * GBPS, rel=FLOAT64_FORMULA_RTOL)
    assert model.link(2, 3, 10)[0] == pytest.approx(2 * GBPS, rel=FLOAT64_FORMULA_RTOL)
    assert model.link(0, 1, 10)[0] == pytest.approx(4 * GBPS, rel=FLOAT64_FORMULA_RTOL)
    assert model.link(2, 3, 20)[0] == pytest.approx(4 * GBPS, rel=FLOAT64_FORMULA_RTOL)


@pytest.mark.parametrize(
    "links",
    [
        [LinkSpec(ranks=[0, 0], bandwidth_gbps=1.0)],
        [LinkSpec(ranks=[0, 4], bandwidth_gbps=1.0)],
        [LinkSpec(ranks=[0, 1], bandwidth_gbps=1.0), LinkSpec(ranks=[1, 0], bandwidth_gbps=2.0)],
    ],
)
def test_bad_links_are_rejected(links: list[LinkSpec]) -> None:
    with pytest.raises(ValueError, match="links"):
        _model(links=links)


def test_link_class_is_the_listed_peer_else_the_default_and_the_slowest_when_mixed() -> None:
    """Shaped mode's tc classes: a listed link has its own class (keyed by the peer), every
    unlisted peer shares the default (None); traffic to several classes goes on the slowest."""
    model = _model(**SLOW_LINK)  # 3-0 listed at 0.8 Gbit/s, the default 8 Gbit/s
    assert model.link_class(0, [3], 0) == 3 and model.link_class(3, [0], 0) == 0
    assert model.link_class(0, [1], 0) is None and model.link_class(0, [1, 2], 0) is None
    assert model.link_class(0, [0], 0) is None and model.link_class(0, [], 0) is None
    assert model.link_class(0, [3, 1], 0) == 3  # a ring 3-0-1: the slow listed link sets it
    fast = _model(bandwidth_gbps=1.0, links=[LinkSpec(ranks=[0, 1], bandwidth_gbps=8.0)])
    assert fast.link_class(0, [1], 0) == 1 and fast.link_class(0, [1, 2], 0) is None
    # The listed link preempted below the default's rate becomes the slowest of the ring.
    cut = PreemptionSpec(factor=0.1, ranks=[1], start_step=5)
    slowed = _model(
        bandwidth_gbps=1.0, links=[LinkSpec(ranks=[0, 1], bandwidth_gbps=8.0)], preemptions=[cut]
    )
    assert slowed.link_class(0, [1, 3], 4) is None and slowed.link_class(0, [1, 3], 5) == 1
    # Equal rates: the default class first.
    even = _model(bandwidth_gbps=1.0, links=[LinkSpec(ranks=[0, 2], bandwidth_gbps=1.0)])
    assert even.link_class(0, [2, 1], 0) is None


def test_each_call_goes_on_the_class_of_the_peers_it_exchanges_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PP=2 x TP=2 as the pipeline bench lays it out: TP pairs (0, 1) and (2, 3) on listed
    1 Gbit/s links, the stage links unlisted. Rank 2's TP all-gather (its group's ring: peer 3)
    travels on the listed class, its p2p to rank 0 on the default one; a world all-reduce
    (ring 1-2-3: peers 1 and 3) on the slower default class."""
    tp_pairs = [
        LinkSpec(ranks=[0, 1], bandwidth_gbps=1.0),
        LinkSpec(ranks=[2, 3], bandwidth_gbps=1.0),
    ]
    model = _model(bandwidth_gbps=0.007, links=tp_pairs)
    tp_group = object()
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [2, 3])
    ctx = ModelContext(model, rank=2, world_size=4, step=0)
    x = torch.zeros(8)

    def link(name: str, **kwargs: object) -> int | None:
        return COLLECTIVES[name].transfer(CallArgs({}, (), kwargs), 0, 2, ctx).link

    assert link("all_gather_into_tensor", output_tensor=x, input_tensor=x, group=tp_group) == 3
    assert link("isend", tensor=x, dst=0) is None and link("irecv", tensor=x, src=0) is None
    assert link("isend", tensor=x, dst=3) == 3
    assert link("all_reduce", tensor=x) is None  # WORLD: ring neighbours 1 and 3
    ops = [dist.P2POp(dist.isend, x, 3), dist.P2POp(dist.irecv, x, 0)]
    assert link("batch_isend_irecv", p2p_op_list=ops) is None  # the slower of 3's and 0's
