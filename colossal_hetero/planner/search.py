"""A* search over per-layer strategies, with the activation layout as the search state.

The graph is layered: node ``(i, state)`` is "layers before i are decided and the activation
entering layer i has this placement (and the open residual branch that one)". An edge picks the
layer's :class:`Choice` (strategy, collective variant, gradient sync, residual layout) and costs
the re-sharding into the strategy's input placement, the layer's own terms, and the re-sharding
back to the residual layout when the layer closes a residual. The states per layer are few (a
handful of placements), so A* with a best-cost-per-node table (dominance pruning) is linear in
the number of layers; edges of identical layers are costed once.

The heuristic is the sum of the remaining layers' cheapest compute term, which every edge pays
at least, so it is admissible and consistent and the first goal popped is optimal.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from colossal_hetero.planner.affine import Affine
from colossal_hetero.planner.cost import (
    Collective,
    CostModel,
    GradSync,
    Layout,
    Loads,
    Placement,
    Tensor,
    Term,
)
from colossal_hetero.planner.spec import LayerKind, LayerSpec, Strategy


class Space(str, Enum):
    """Which programs the search may return."""

    FULL = "full"
    """Every strategy, residual layout (R or B), collective variant and gradient sync."""
    MEGATRON = "megatron"
    """Stock shardformer strategies (``LayerSpec.default``), replicated residual stream, padded
    collectives, all-reduced gradients: what the plugin's resizable layers execute in every
    layout, and stock Colossal-AI's baseline."""
    MEGATRON_SFB = "megatron_sfb"
    """MEGATRON where, without tensor parallelism (tp_size 1), replicated linear weights may
    also sync by SFB over the data-parallel group: what the plugin executes when Colossal-AI
    wraps the model in torch DDP (zero_stage 0, pp 1; ``colossal_hetero.plugin.grad_sync``)."""

    @classmethod
    def executed(cls, *, tp: int, pp: int, zero_stage: int) -> Space:
        """The space the plugin executes for a layout: SFB only where torch DDP syncs
        whole, unsharded modules (no TP, no pipeline, no ZeRO)."""
        return cls.MEGATRON_SFB if tp == 1 and pp == 1 and zero_stage == 0 else cls.MEGATRON


@dataclass(frozen=True, slots=True)
class State:
    """The activation entering a layer, the open residual branch's layout (if any), and the
    strategy of the embedding whose weight a later tied layer shares (until that layer)."""

    place: Placement
    residual: Layout | None = None
    tied: Strategy | None = None


# A tied LM head must hold its shared weight the way the embedding does: vocab split (embedding
# row, head column), hidden split (embedding column, head row), or whole on every device.
_TIED_PARTNER = {
    Strategy.ROW: Strategy.COLUMN,
    Strategy.COLUMN: Strategy.ROW,
    Strategy.REPLICATE: Strategy.REPLICATE,
    Strategy.DATA: Strategy.DATA,
}


START = State(Placement(Layout.INPUT))


@dataclass(frozen=True, slots=True)
class Choice:
    """What the search decides for one layer."""

    strategy: Strategy
    collective: Collective = Collective.PADDED
    grad_sync: GradSync = GradSync.ALLREDUCE
    residual: Layout | None = None
    """Layout of the residual stream, chosen at layers that open a residual branch."""


@dataclass(frozen=True, slots=True)
class Program:
    """A complete choice sequence, the states it passes through, and its cost."""

    choices: tuple[Choice, ...]
    states: tuple[State, ...]
    """State entering each layer."""
    cost: float


class Problem:
    """The search graph of a model on a mesh: per-layer choices and edge terms."""

    def __init__(self, cost: CostModel, space: Space = Space.FULL) -> None:
        self.cost, self.space = cost, space
        self.layers = cost.model.layers
        self.choices = tuple(self._choices(layer) for layer in self.layers)
        first = self.layers[0]
        inputs = [
            Tensor(first.tokens, 1 if first.kind is LayerKind.EMBEDDING else first.in_features)
        ]
        inputs += [Tensor(la.tokens, la.out_features) for la in self.layers[:-1]]
        self.inputs = tuple(inputs)
        # Layers with equal signatures and inputs have equal edges: cost them once.
        ids: dict[tuple, int] = {}
        self.edge_class = tuple(
            ids.setdefault((la.signature, x), len(ids))
            for la, x in zip(self.layers, self.inputs, strict=True)
        )
        tied = any(la.tied for la in self.layers)
        owners = [i for i, la in enumerate(self.layers) if la.kind is LayerKind.EMBEDDING]
        if tied and not owners:
            raise ValueError("a layer is tied but the model has no embedding to share weights with")
        self.tie_owner = owners[0] if tied else None

    def _strategies(self, layer: LayerSpec) -> tuple[Strategy, ...]:
        if self.cost.mesh.tp_size == 1:
            return (Strategy.REPLICATE,)  # every strategy is the whole layer on one device
        allowed = self.cost.strategies(layer)
        if self.space is not Space.FULL:
            if layer.default not in allowed:
                raise ValueError(f"layer {layer.name}: default {layer.default} does not apply")
            return (layer.default,)
        return allowed

    def _choices(self, layer: LayerSpec) -> tuple[Choice, ...]:
        mesh = self.cost.mesh
        residuals: tuple[Layout | None, ...] = (None,)
        if layer.opens_residual:
            full = self.space is Space.FULL and mesh.tp_size > 1
            residuals = (Layout.R, Layout.B) if full else (Layout.R,)
        collectives: tuple[Collective, ...] = (Collective.PADDED, Collective.GROUPED)
        # The resizable layers run padded collectives: plan only what will execute. Without
        # tensor parallelism the only uneven gather is SFB's, which runs either way.
        sfb_only = self.space is Space.MEGATRON_SFB and mesh.tp_size == 1
        if mesh.num_devices == 1 or not (self.space is Space.FULL or sfb_only):
            collectives = (Collective.PADDED,)
        out = []
        for strategy in self._strategies(layer):
            syncs = [GradSync.ALLREDUCE]
            if self._offers_sfb(layer, strategy):
                syncs.append(GradSync.SFB)
            for residual, sync, coll in itertools.product(residuals, syncs, collectives):
                out.append(Choice(strategy, coll, sync, residual))
        return tuple(out)

    def _offers_sfb(self, layer: LayerSpec, strategy: Strategy) -> bool:
        if not self.cost.sfb_applies(layer, strategy):
            return False
        if self.space is Space.FULL:
            return True
        # The runtime (colossal_hetero.comm.sfb) hooks whole nn.Linear / Conv1D modules.
        return self.space is Space.MEGATRON_SFB and self.cost.mesh.tp_size == 1

    def walk(
        self, index: int, state: State, choice: Choice, move: Callable, own: Callable
    ) -> tuple[list[Any], State] | None:
        """The state machine of one edge, generic in how its parts are costed.

        ``move(tensor, src, dst)`` re-lays an activation and ``own()`` costs the layer itself;
        both return ``(part, uses_method)`` (``move`` None if impossible). Returns the parts in
        order and the next state, or None if the edge is invalid. A grouped choice none of whose
        parts has an uneven gather is invalid: it would only duplicate its padded twin.
        """
        layer, x = self.layers[index], self.inputs[index]
        parts: list[Any] = []
        uses_method = False
        place, residual, tied = state.place, state.residual, state.tied
        if index == self.tie_owner:
            tied = choice.strategy
        elif layer.tied:
            if tied is None or choice.strategy is not _TIED_PARTNER[tied]:
                return None
            tied = None

        def step(part: tuple[Any, bool] | None) -> bool:
            nonlocal uses_method
            if part is None:
                return False
            parts.append(part[0])
            uses_method |= part[1]
            return True

        if layer.opens_residual:
            if residual is not None or choice.residual is None:
                return None
            residual = choice.residual
            if not step(move(x, place, Placement(residual))):
                return None
            place = Placement(residual)
        io = self.cost.io(layer, choice.strategy)
        if not step(move(x, place, io.source)):
            return None
        step(own())
        place = io.result
        if layer.closes_residual:
            assert residual is not None
            y = Tensor(layer.tokens, layer.out_features)
            if not step(move(y, place, Placement(residual))):
                return None
            place, residual = Placement(residual), None
        if choice.collective is Collective.GROUPED and not uses_method:
            return None
        return parts, State(place, residual, tied)

    def edge_terms(
        self, index: int, state: State, choice: Choice, loads: Loads
    ) -> tuple[list[Term], State] | None:
        """Terms of taking ``choice`` at layer ``index`` from ``state``; None if invalid."""
        cm, method = self.cost, choice.collective
        walked = self.walk(
            index,
            state,
            choice,
            lambda t, src, dst: cm.transition(t, src, dst, method, loads),
            lambda: cm.layer_terms(
                self.layers[index], choice.strategy, choice.grad_sync, method, loads
            ),
        )
        if walked is None:
            return None
        return [term for part in walked[0] for term in part], walked[1]

    def bind(self, loads: Loads) -> EdgeCosts:
        """Edge costs at fixed numeric ``loads``, cached per edge class."""
        return EdgeCosts(self, loads)

    def replay(self, choices: tuple[Choice, ...]) -> tuple[State, ...]:
        """The states ``choices`` pass through; ValueError if the sequence is invalid."""
        if len(choices) != len(self.layers):
            raise ValueError(f"need {len(self.layers)} choices, got {len(choices)}")
        probe = _zero_loads(self.cost)
        states, state = [], START
        for i, choice in enumerate(choices):
            states.append(state)
            step = self.edge_terms(i, state, choice, probe)
            if step is None:
                raise ValueError(f"layer {self.layers[i].name}: {choice} is invalid after {state}")
            state = step[1]
        return tuple(states)


def _zero_loads(cost: CostModel) -> Loads:
    # Validity does not depend on loads; any numbers do for replaying a program.
    n = cost.mesh.num_devices
    return Loads(np.ones(n), np.ones(n), np.full(n, 1.0 / cost.mesh.tp_size))


def term_value(term: Term) -> float:
    """The time of a numeric term: the maximum of its rows."""
    assert not isinstance(term.rows, Affine), "affine terms have no value before the LP"
    return float(np.max(term.rows))


def _total(terms: list[Term]) -> float:
    return sum(term_value(t) for t in terms)


class EdgeCosts:
    """Numeric edge costs of a :class:`Problem` at fixed loads.

    Memoised at two levels: whole edges per (edge class, state, choice), and their parts
    (re-layouts per tensor and placements, the layer's own terms per edge class and choice),
    which many edges share.
    """

    def __init__(self, problem: Problem, loads: Loads) -> None:
        self.problem, self.loads = problem, loads
        self._edges: dict[tuple, tuple[float, State] | None] = {}
        self._moves: dict[tuple, tuple[float, bool] | None] = {}
        self._own: dict[tuple, tuple[float, bool]] = {}

    def _move(self, tensor: Tensor, src: Placement, dst: Placement, method: Collective):
        key = (tensor, src, dst, method)
        if key not in self._moves:
            step = self.problem.cost.transition(tensor, src, dst, method, self.loads)
            self._moves[key] = None if step is None else (_total(step[0]), step[1])
        return self._moves[key]

    def _layer(self, index: int, choice: Choice):
        key = (self.problem.edge_class[index], choice.strategy, choice.grad_sync, choice.collective)
        if key not in self._own:
            terms, uses = self.problem.cost.layer_terms(
                self.problem.layers[index],
                choice.strategy,
                choice.grad_sync,
                choice.collective,
                self.loads,
            )
            self._own[key] = (_total(terms), uses)
        return self._own[key]

    def edge(self, index: int, state: State, choice: Choice) -> tuple[float, State] | None:
        """``(cost, next state)`` of ``choice`` at layer ``index``, or None if invalid."""
        key = (self.problem.edge_class[index], state, choice)
        if key not in self._edges:
            method = choice.collective
            walked = self.problem.walk(
                index,
                state,
                choice,
                lambda t, src, dst: self._move(t, src, dst, method),
                lambda: self._layer(index, choice),
            )
            self._edges[key] = None if walked is None else (sum(walked[0]), walked[1])
        return self._edges[key]

    def floors(self) -> list[float]:
        """Per layer, the cheapest compute term over its choices (the heuristic's parts)."""
        problem = self.problem
        memo: dict[int, float] = {}
        for i, layer in enumerate(problem.layers):
            cls = problem.edge_class[i]
            if cls not in memo:
                strategies = sorted({c.strategy for c in problem.choices[i]}, key=lambda s: s.value)
                memo[cls] = min(self._compute(layer, s) for s in strategies)
        return [memo[cls] for cls in problem.edge_class]

    def _compute(self, layer: LayerSpec, strategy: Strategy) -> float:
        # Gradient sync and collectives only add terms (SFB adds compute): a lower bound.
        terms, _ = self.problem.cost.layer_terms(
            layer, strategy, GradSync.ALLREDUCE, Collective.PADDED, self.loads
        )
        assert terms[0].compute
        return term_value(terms[0])


def astar(problem: Problem, loads: Loads) -> Program:
    """The cheapest program at numeric ``loads`` (exact under the cost model).

    Deterministic: choices are expanded in a fixed order and heap ties break by insertion.
    """
    edges = problem.bind(loads)
    num_layers = len(problem.layers)
    floors = edges.floors()
    remaining = [0.0] * (num_layers + 1)
    for i in range(num_layers - 1, -1, -1):
        remaining[i] = remaining[i + 1] + floors[i]
    best: dict[tuple[int, State], float] = {(0, START): 0.0}
    parent: dict[tuple[int, State], tuple[tuple[int, State], Choice]] = {}
    tie = itertools.count()
    heap = [(remaining[0], next(tie), 0.0, 0, START)]
    while heap:
        _, _, g, pos, state = heapq.heappop(heap)
        if g != best[(pos, state)]:
            continue  # superseded by a cheaper path to the same node
        if pos == num_layers:
            return _unwind(parent, (pos, state), g)
        for choice in problem.choices[pos]:
            step = edges.edge(pos, state, choice)
            if step is None:
                continue
            cost, nxt = step
            key, new_g = (pos + 1, nxt), g + cost
            if new_g < best.get(key, np.inf):
                best[key] = new_g
                parent[key] = ((pos, state), choice)
                heapq.heappush(heap, (new_g + remaining[pos + 1], next(tie), new_g, pos + 1, nxt))
    raise ValueError("no valid program: every choice sequence fails a layout transition")


def _unwind(parent: dict, node: tuple[int, State], cost: float) -> Program:
    choices, states = [], []
    while node in parent:
        node, choice = parent[node]
        choices.append(choice)
        states.append(node[1])
    return Program(tuple(reversed(choices)), tuple(reversed(states)), cost)


def brute_force(problem: Problem, loads: Loads) -> Program:
    """The cheapest program by enumerating every choice sequence (tests, tiny models only)."""
    edges = problem.bind(loads)
    best: Program | None = None
    for choices, states, cost in _enumerate(problem, edges, 0, START):
        if best is None or cost < best.cost:
            best = Program(choices, states, cost)
    if best is None:
        raise ValueError("no valid program: every choice sequence fails a layout transition")
    return best


def _enumerate(
    problem: Problem, edges: EdgeCosts, pos: int, state: State
) -> Iterator[tuple[tuple[Choice, ...], tuple[State, ...], float]]:
    if pos == len(problem.layers):
        yield (), (), 0.0
        return
    for choice in problem.choices[pos]:
        step = edges.edge(pos, state, choice)
        if step is None:
            continue
        cost, nxt = step
        for rest, states, rest_cost in _enumerate(problem, edges, pos + 1, nxt):
            yield (choice, *rest), (state, *states), cost + rest_cost


def program_cost(problem: Problem, choices: tuple[Choice, ...], loads: Loads) -> float:
    """Cost of a fixed program at numeric ``loads``."""
    edges = problem.bind(loads)
    total, state = 0.0, START
    for i, choice in enumerate(choices):
        step = edges.edge(i, state, choice)
        if step is None:
            raise ValueError(f"layer {problem.layers[i].name}: {choice} is invalid after {state}")
        total += step[0]
        state = step[1]
    return total
