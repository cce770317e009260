"""Mixture-of-experts support: speed-aware expert placement and the packing planner (pure), and
the chunked, prioritised gradient reducer (runtime). See docs/moe.md."""

from colossal_hetero.moe.chunks import Chunk, Segment, plan_chunks
from colossal_hetero.moe.packing import (
    SendCounts,
    a2a_sends,
    check_routing,
    coselection,
    packing_aware_placement,
    packing_objective,
)
from colossal_hetero.moe.placement import (
    EXACT_MAX_EXPERTS,
    Placement,
    check_ep,
    check_placement_inputs,
    even_placement,
    exact_placement,
    greedy_placement,
    place_experts,
    placement_from_groups,
)

__all__ = [
    "Chunk",
    "Segment",
    "plan_chunks",
    "EXACT_MAX_EXPERTS",
    "Placement",
    "SendCounts",
    "a2a_sends",
    "check_ep",
    "check_placement_inputs",
    "check_routing",
    "coselection",
    "even_placement",
    "exact_placement",
    "greedy_placement",
    "packing_aware_placement",
    "packing_objective",
    "place_experts",
    "placement_from_groups",
]
