"""The torch.distributed functions the interceptor wraps, and what each call moves.

Each entry reads the call's own arguments (by name or position, per the wrapped function's
signature) to find the bytes this rank sends, the group's global ranks and, under a network
model, the modelled time of the call on each direction of the rank's link. Object collectives
have no entry of their own: the tensor collectives they call inside are counted instead (see
``CollectiveInterceptor``).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from colossal_hetero.emulation.network import NetworkModel


class CallArgs:
    """Arguments of one call, looked up by parameter name whatever way they were passed."""

    __slots__ = ("args", "kwargs", "_positions")

    def __init__(self, positions: dict[str, int], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self._positions, self.args, self.kwargs = positions, args, kwargs

    def get(self, name: str, default: Any = None) -> Any:
        """The argument ``name``, or ``default`` when the caller left it out."""
        if name in self.kwargs:
            return self.kwargs[name]
        index = self._positions.get(name, len(self.args))
        return self.args[index] if index < len(self.args) else default


def parameter_positions(fn: Callable[..., Any]) -> dict[str, int]:
    """Parameter name -> position, read once per wrapped function (follows ``__wrapped__``)."""
    return {name: i for i, name in enumerate(inspect.signature(fn).parameters)}


@dataclass(frozen=True, slots=True)
class ModelContext:
    """What a time function needs besides the call: the model, this rank, the step."""

    network: NetworkModel
    rank: int
    world_size: int
    step: int

    def ranks(self, group: dist.ProcessGroup | None) -> list[int]:
        """Global ranks of ``group`` in group order; None is WORLD."""
        if group is None or group is dist.GroupMember.WORLD:
            return list(range(self.world_size))
        return dist.get_process_group_ranks(group)


@dataclass(frozen=True, slots=True)
class Transfer:
    """What one call moves, as this rank sees it."""

    sent: int = 0
    """Payload bytes this rank hands the call to send (see ``StepTiming.bytes_by_kind``)."""

    egress: float = 0.0
    """Modelled seconds on the sending direction of this rank's link (0: unused)."""

    ingress: float = 0.0
    """Modelled seconds on the receiving direction (0: unused)."""

    stream: Hashable = None
    """The connection it travels on: its process group (``"world"`` for the default one), whose
    transfers the link delivers in order (see ``link_timeline``)."""

    link: int | None = None
    """The class of this rank's link it travels on (``NetworkModel.link_class``): a listed
    peer's, or None for the default class."""

    @property
    def seconds(self) -> float:
        """The call's modelled time: both directions run at once."""
        return max(self.egress, self.ingress)

    def __add__(self, other: Transfer) -> Transfer:
        """Two calls made one after the other (an object collective's nested calls)."""
        return Transfer(
            self.sent + other.sent,
            self.egress + other.egress,
            self.ingress + other.ingress,
            self.stream if self.stream is not None else other.stream,
            self.link if self.stream is not None else other.link,
        )


# (call arguments, this rank's global rank) -> payload bytes this rank sends.
SentFn = Callable[[CallArgs, int], int]
Timed = tuple[float, float, Sequence[int]]
"""A call's modelled (egress, ingress) seconds and the global ranks this rank exchanges bytes
with in it (which class of its link it uses: ``NetworkModel.link_class``)."""

# (context, call arguments, the call's return value) -> its modelled times and peers.
TimeFn = Callable[[ModelContext, CallArgs, Any], Timed]


@dataclass(frozen=True, slots=True)
class Collective:
    """One wrapped function: its metrics kind, and how to read what a call moves.

    ``sent`` and ``time`` are None for object collectives, whose pickled sizes are unknown up
    front: the tensor collectives they run inside are counted instead.
    """

    kind: str
    sent: SentFn | None
    time: TimeFn | None

    def transfer(
        self, call: CallArgs, result: Any, rank: int, ctx: ModelContext | None
    ) -> Transfer:
        """Bytes this rank sends in ``call``, and its modelled times when ``ctx`` is given."""
        if self.sent is None or self.time is None:
            return Transfer()
        sent = self.sent(call, rank)
        if ctx is None:
            return Transfer(sent)
        egress, ingress, peers = self.time(ctx, call, result)
        link = ctx.network.link_class(rank, peers, ctx.step)
        return Transfer(sent, egress, ingress, _stream(call), link)


def _stream(call: CallArgs) -> Hashable:
    """The process group a call runs on (a batch: its first op's), ``"world"`` for the default:
    gloo gives each group its own connections, and each delivers its bytes in order."""
    ops = call.get("p2p_op_list")
    group = ops[0].group if ops else call.get("group")
    return "world" if group is None or group is dist.GroupMember.WORLD else group


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _total(tensors: Sequence[torch.Tensor] | None) -> int:
    return sum(_nbytes(t) for t in tensors or ())


# -- bytes sent -------------------------------------------------------------------------------


def _sends(arg: str, list_arg: bool = False) -> SentFn:
    """Every rank sends its argument ``arg`` (a tensor, or a list of them)."""

    def sent(call: CallArgs, _: int) -> int:
        value = call.get(arg)
        return _total(value) if list_arg else _nbytes(value)

    return sent


def _root_sends(arg: str, root_arg: str, list_arg: bool = False) -> SentFn:
    """Only the root (global rank ``root_arg``, default 0) sends ``arg``."""

    def sent(call: CallArgs, rank: int) -> int:
        if rank != call.get(root_arg, 0):
            return 0
        value = call.get(arg)
        return _total(value) if list_arg else _nbytes(value)

    return sent


def _non_root_sends(root_arg: str) -> SentFn:
    """Every rank but the root sends its ``tensor`` (reduce and gather towards the root)."""

    def sent(call: CallArgs, rank: int) -> int:
        return 0 if rank == call.get(root_arg, 0) else _nbytes(call.get("tensor"))

    return sent


def _sends_nothing(call: CallArgs, rank: int) -> int:
    return 0


def _batch_sent(call: CallArgs, _: int) -> int:
    return sum(_nbytes(op.tensor) for op in call.get("p2p_op_list") if op.op is dist.isend)


# -- modelled times ---------------------------------------------------------------------------


def _both(seconds: float, peers: Sequence[int]) -> Timed:
    """A collective sends and receives at once: both directions, for the whole time."""
    return seconds, seconds, peers


def _ring_peers(ranks: Sequence[int], rank: int) -> tuple[int, ...]:
    """The rank before and after ``rank`` in a ring over ``ranks`` (group order)."""
    if rank not in ranks:
        return ()
    i = ranks.index(rank)
    return ranks[i - 1], ranks[(i + 1) % len(ranks)]


def _all_reduce(ctx: ModelContext, call: CallArgs, _: Any) -> Timed:
    ranks = ctx.ranks(call.get("group"))
    seconds = ctx.network.all_reduce_time(ranks, _nbytes(call.get("tensor")), ctx.step)
    return _both(seconds, _ring_peers(ranks, ctx.rank))


def _gathered(arg: str, list_arg: bool) -> TimeFn:
    """All-gather / reduce-scatter time from the full tensor (or list of pieces) ``arg``."""

    def time(ctx: ModelContext, call: CallArgs, _: Any) -> Timed:
        full, ranks = call.get(arg), ctx.ranks(call.get("group"))
        total = _total(full) if list_arg else _nbytes(full)
        seconds = ctx.network.all_gather_time(ranks, total, ctx.step)
        return _both(seconds, _ring_peers(ranks, ctx.rank))

    return time


def _all_to_all(arg: str, list_arg: bool) -> TimeFn:
    def time(ctx: ModelContext, call: CallArgs, _: Any) -> Timed:
        local, ranks = call.get(arg), ctx.ranks(call.get("group"))
        nbytes = _total(local) if list_arg else _nbytes(local)
        return _both(ctx.network.all_to_all_time(ranks, nbytes, ctx.step), ranks)

    return time


def _tree(ctx: ModelContext, call: CallArgs, _: Any) -> Timed:
    ranks = ctx.ranks(call.get("group"))
    seconds = ctx.network.broadcast_time(ranks, _nbytes(call.get("tensor")), ctx.step)
    return _both(seconds, ranks)


def _rooted(root_arg: str) -> TimeFn:
    """Gather to / scatter from a root: each rank holds ``tensor``, the root moves n of them."""

    def time(ctx: ModelContext, call: CallArgs, _: Any) -> Timed:
        ranks, root = ctx.ranks(call.get("group")), call.get(root_arg, 0)
        total = _nbytes(call.get("tensor")) * len(ranks)
        seconds = ctx.network.gather_time(ranks, root, total, ctx.step)
        return _both(seconds, ranks if ctx.rank == root else (root,))

    return time


def _send(ctx: ModelContext, call: CallArgs, _: Any) -> Timed:
    nbytes, dst = _nbytes(call.get("tensor")), call.get("dst")
    return ctx.network.p2p_time(ctx.rank, dst, nbytes, ctx.step), 0.0, (dst,)


def _recv(ctx: ModelContext, call: CallArgs, source: Any) -> Timed:
    # recv(src=None) receives from any rank and returns the sender's global rank.
    src = call.get("src")
    src = source if src is None else src
    return 0.0, ctx.network.p2p_time(src, ctx.rank, _nbytes(call.get("tensor")), ctx.step), (src,)


def _batch_p2p(ctx: ModelContext, call: CallArgs, _: Any) -> Timed:
    """The ops of a batch run concurrently and links are full-duplex: bytes add up per
    direction of each pair's link, and each direction of the rank's link is busy as long as
    its slowest pair."""
    nbytes: dict[tuple[int, int], int] = defaultdict(int)
    for op in call.get("p2p_op_list"):
        pair = (ctx.rank, op.peer) if op.op is dist.isend else (op.peer, ctx.rank)
        nbytes[pair] += _nbytes(op.tensor)
    egress = ingress = 0.0
    for (src, dst), size in nbytes.items():
        seconds = ctx.network.p2p_time(src, dst, size, ctx.step)
        if src == ctx.rank:
            egress = max(egress, seconds)
        else:
            ingress = max(ingress, seconds)
    return egress, ingress, [op.peer for op in call.get("p2p_op_list")]


def _barrier(ctx: ModelContext, call: CallArgs, _: Any) -> Timed:
    ranks = ctx.ranks(call.get("group"))
    return _both(ctx.network.barrier_time(ranks, ctx.step), ranks)


COLLECTIVES: dict[str, Collective] = {
    "all_reduce": Collective("all_reduce", _sends("tensor"), _all_reduce),
    "all_gather": Collective("other", _sends("tensor"), _gathered("tensor_list", True)),
    "all_gather_into_tensor": Collective(
        "other", _sends("input_tensor"), _gathered("output_tensor", False)
    ),
    "reduce_scatter": Collective(
        "other", _sends("input_list", True), _gathered("input_list", True)
    ),
    "reduce_scatter_tensor": Collective("other", _sends("input"), _gathered("input", False)),
    "all_to_all": Collective(
        "all_to_all", _sends("input_tensor_list", True), _all_to_all("input_tensor_list", True)
    ),
    "all_to_all_single": Collective("all_to_all", _sends("input"), _all_to_all("input", False)),
    "broadcast": Collective("other", _root_sends("tensor", "src"), _tree),
    "reduce": Collective("other", _non_root_sends("dst"), _tree),
    "send": Collective("p2p", _sends("tensor"), _send),
    "recv": Collective("p2p", _sends_nothing, _recv),
    "batch_isend_irecv": Collective("p2p", _batch_sent, _batch_p2p),
    # The pipeline's kFkB schedule (pipeline/p2p.py) posts single non-blocking sends/receives.
    "isend": Collective("p2p", _sends("tensor"), _send),
    "irecv": Collective("p2p", _sends_nothing, _recv),
    "barrier": Collective("other", _sends_nothing, _barrier),
    "gather": Collective("other", _non_root_sends("dst"), _rooted("dst")),
    "scatter": Collective("other", _root_sends("scatter_list", "src", True), _rooted("src")),
    # Pickled sizes are unknown up front: the tensor collectives they run inside count instead.
    "all_gather_object": Collective("other", None, None),
    "broadcast_object_list": Collective("other", None, None),
}
"""Every wrapped function name -> what its calls move and their metrics kind."""

WRAPPED_NAMES: tuple[str, ...] = tuple(COLLECTIVES)

ALWAYS_ASYNC: frozenset[str] = frozenset({"batch_isend_irecv", "isend", "irecv"})
"""Names whose calls always return works to wait on (they take no ``async_op``)."""

WATCHED_P2P: frozenset[str] = frozenset({"isend", "irecv"})
"""Single non-blocking point-to-point calls: under a network model on a host backend their
real completion is stamped (``arrival.CompletionWatch``), so a message cannot land before its
data moved plus the modelled time. A batch keeps the late-peer test instead (its works are
waited one by one, and one stamp per batch would tie them together)."""
