"""Non-blocking point-to-point for pipeline stages: sends never wait, receives are posted early.

Runtime half of the kFkB schedule (uses torch.distributed). One :class:`Outbox` per direction
a stage sends in and one :class:`Inbox` per direction it receives from. Along one ordered pair of
ranks only one kind of message flows (activations downstream, gradients upstream), and both
sides issue their operations in the same order, so FIFO matching pairs every receive with the
send meant for it.

Wire format of one message (an object: a pytree of tensors, e.g. ``{"hidden_states": x}``):
``[header int64[1]: payload length] [payload uint8: pickled P2PMetadata] [tensor_0 ...]``, where
the header travels only with a step's first message on the link (shapes do not change within a
step: micro-batches have equal size) or with every message whose object carries non-tensor
leaves.

**The first message without rendezvous.** gloo moves a message only once the receiver's "ready"
for it has reached the sender, so a receive posted late costs a trip across the link before the
data moves. Reading the metadata first cost the step's first message two such trips in a row
(payload, then tensors), through whatever queue sits on the receiver-to-sender path (a tenant's
20-57 ms on a preempted download: 80-146 ms per step's first gradient, PP=2 x TP=2). So both
ends remember the last step's first metadata (when its object had tensors only): the receiver
posts the header and that metadata's tensor receives together as a step starts, and a sender
whose metadata is unchanged sends a header of 0 and the tensors, which then move as soon as they
are sent. When the metadata changed (a new batch size), the sender fills the receives posted on
the old metadata with zeros of those shapes, then sends the length and the payload: the
receiver drops the zeros and reads the new metadata, so any change stays safe.

Accounting (per step, for the Ada tuner and the benchmark): each box keeps a :class:`LinkLog`
of its direction: the bytes it moved, the seconds it was blocked in ``wait()``, and a clock time
per message (``time.time()``: when a message went onto the link, or when a blocked receive
returned; see ``pipeline/profile.py`` for how link time follows from them). The boxes call
``torch.distributed.isend``/``irecv`` by name at call time, so the emulation interceptor sees
them too: its model books them on the link timeline and its per-kind metrics count them as p2p.

**Messages split over a tensor-parallel group** (:class:`TPSlice`). Under 1D tensor parallelism
every rank of a stage's TP group holds the same hidden states between blocks (the row-parallel
all-reduce leaves them replicated; so are the input gradients after the column-parallel one),
and each TP rank sends its copy to its counterpart in the next stage. With a ``TPSlice`` the
sender puts only its ``1/size`` of each tensor (flattened, equal contiguous pieces) on its link,
and the receiver rebuilds the tensor with one ``all_gather`` on its TP group (a fast link inside
the stage) when it takes the message: each stage link carries ``1/size`` of the bytes. A tensor
whose element count ``size`` does not divide travels whole; so does the metadata. With
``units`` (set between steps by the Ada controller, ``pipeline/link_shares.py``) the pieces
follow the links' measured speeds instead of being equal.
"""

from __future__ import annotations

import pickle
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from colossalai.pipeline.p2p import P2PMetadata, create_send_metadata
from torch.utils._pytree import tree_unflatten

from colossal_hetero.pipeline.link_shares import piece_bounds
from colossal_hetero.pipeline.profile import NOT_BLOCKED

BLOCKED_S = 1e-4
"""A ``wait()`` longer than this waited for data (shorter: the data had already landed)."""


@dataclass(slots=True)
class LinkLog:
    """One step's traffic in one direction of one boundary, as this rank saw it."""

    times: list[float] = field(default_factory=list)
    """Per message, in order: when it went onto the link (a sender), or when its blocked wait
    returned, ``NOT_BLOCKED`` when the wait did not block (a receiver; under a
    :class:`TPSlice`, its own piece's wait, before the gather of the others); ``time.time()``."""
    posted: list[float] = field(default_factory=list)
    """A receiver's: per message, when its tensors' receives were posted."""
    asked: list[float] = field(default_factory=list)
    """A receiver's: per message, when it asked for it (``get`` began): a wait that returns
    much later than that really waited for the data."""
    nbytes: int = 0
    """Bytes of the tensors moved, headers and metadata included."""
    wait_s: float = 0.0
    """Seconds spent blocked in ``wait()`` on this direction's operations (a receiver's: in
    ``get``, the TP gather included)."""


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True, slots=True)
class TPSlice:
    """This rank's share of messages replicated over its tensor-parallel group: piece ``index``
    of ``size`` (the rank's position in ``group``, which has ``size`` ranks).

    ``units``: each TP rank's share of a message in units (``pipeline/link_shares.py``; both
    ends of a link must hold the same), so that a slower link carries less; empty: equal
    pieces."""

    group: dist.ProcessGroup
    index: int
    size: int
    units: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert not self.units or (len(self.units) == self.size and min(self.units) >= 1)

    def _bounds(self, numel: int) -> list[tuple[int, int]] | None:
        """Every piece's ``[start, stop)`` in the flattened tensor; None: it travels whole."""
        if self.size < 2 or numel <= 0:
            return None
        if not self.units:
            if numel % self.size:
                return None
            n = numel // self.size
            return [(n * t, n * (t + 1)) for t in range(self.size)]
        if numel < sum(self.units):
            return None
        return piece_bounds(numel, self.units)

    def splits(self, numel: int) -> bool:
        """Whether a tensor of ``numel`` elements travels in pieces (else whole)."""
        return self._bounds(numel) is not None

    def piece(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous piece of the contiguous ``tensor`` (a view), or all of it."""
        bounds = self._bounds(tensor.numel())
        if bounds is None:
            return tensor
        start, stop = bounds[self.index]
        return tensor.view(-1)[start:stop]

    def gather(self, tensor: torch.Tensor) -> None:
        """Fill the other ranks' pieces of ``tensor`` (this rank's piece already holds its own).

        One ``all_gather`` on ``group``; unequal pieces travel padded to the largest."""
        bounds = self._bounds(tensor.numel())
        if bounds is None:
            return
        flat = tensor.view(-1)
        start, stop = bounds[self.index]
        lengths = {hi - lo for lo, hi in bounds}
        if len(lengths) == 1:  # equal pieces: gather straight into the tensor's views
            views = [flat[lo:hi] for lo, hi in bounds]
            dist.all_gather(views, flat[start:stop].clone(), group=self.group)
            return
        longest = max(lengths)
        own = flat.new_zeros(longest)
        own[: stop - start] = flat[start:stop]
        pieces = [flat.new_empty(longest) for _ in bounds]
        dist.all_gather(pieces, own, group=self.group)
        for t, (lo, hi) in enumerate(bounds):
            if t != self.index:
                flat[lo:hi] = pieces[t][: hi - lo]


class Outbox:
    """Sends objects to ``dst`` (global rank) on ``group`` without waiting for them to land.

    Sent tensors stay referenced until :meth:`finish` (a send reads its buffer until it is done).
    """

    def __init__(
        self,
        dst: int,
        group: dist.ProcessGroup,
        device: torch.device,
        tp: TPSlice | None = None,
    ) -> None:
        self.dst, self.group, self.device, self.tp = dst, group, device, tp
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._sent = 0
        self._every_message_has_header = False
        self._known: tuple[P2PMetadata, bytes] | None = None
        """The last step's first metadata (tensors only) and its pickle: what the receiver
        posts the next step's first receives on (:class:`Inbox`), None when it posts none."""
        self.log = LinkLog()
        """This step's traffic (:meth:`take_log` hands it over and starts a fresh one)."""

    def send(self, obj: Any) -> int:
        """Post the sends of ``obj``; returns the bytes of its tensors put on this link
        (metadata excluded; this rank's pieces only under a :class:`TPSlice`)."""
        metadata, tensors = create_send_metadata(obj, strict=False, return_tensor=True)
        has_objects = bool(metadata.non_tensor_obj_idx)
        if self._sent == 0:
            self._every_message_has_header = has_objects
        # The receiver decides from the step's first message whether headers keep coming.
        assert has_objects == self._every_message_has_header, "message structure changed"
        if self._sent == 0:
            self._send_first_header(metadata, has_objects)
        elif has_objects:
            self._send_metadata(pickle.dumps(metadata))
        sent = 0
        for tensor in tensors:
            piece = tensor.detach().contiguous()
            piece = piece if self.tp is None else self.tp.piece(piece)
            self._isend(piece)
            sent += _nbytes(piece)
        self._sent += 1
        # After the isends returned: an emulated slow device's stretch of the pass happens at
        # the first of them, so this is when the output really went onto the link.
        self.log.times.append(time.time())
        return sent

    def _send_first_header(self, metadata: P2PMetadata, has_objects: bool) -> None:
        """The step's first header: 0 when the receiver's early receives fit ``metadata``,
        else zeros for those receives (if any), then the new length and payload."""
        raw = pickle.dumps(metadata)
        known, self._known = self._known, None if has_objects else (metadata, raw)
        if known is not None and known[1] == raw:
            self._isend(torch.zeros(1, dtype=torch.int64, device=self.device))
            return
        self._isend(torch.tensor([len(raw)], dtype=torch.int64, device=self.device))
        if known is not None:  # the receiver posted these on the old metadata: fill them
            for meta in known[0].tensor_metadata:
                filler = torch.zeros(meta.shape, dtype=meta.dtype, device=self.device)
                self._isend(filler if self.tp is None else self.tp.piece(filler))
        self._send_payload(raw)

    def _send_metadata(self, raw: bytes) -> None:
        """A header and payload of a message with non-tensor leaves (one each)."""
        self._isend(torch.tensor([len(raw)], dtype=torch.int64, device=self.device))
        self._send_payload(raw)

    def _send_payload(self, raw: bytes) -> None:
        payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self._isend(payload.to(self.device))

    def _isend(self, tensor: torch.Tensor) -> None:
        work = dist.isend(tensor, dst=self.dst, group=self.group)
        assert work is not None
        self._pending.append((work, tensor))
        self.log.nbytes += _nbytes(tensor)

    def finish(self) -> None:
        """Wait for every send of this step; the next step starts a fresh link state."""
        start = time.perf_counter()
        for work, _ in self._pending:
            work.wait()
        self.log.wait_s += time.perf_counter() - start
        self._pending.clear()
        self._sent = 0

    def take_log(self) -> LinkLog:
        """This step's log; the box starts a fresh one."""
        log, self.log = self.log, LinkLog()
        return log


class Inbox:
    """Receives ``count`` objects from ``src`` (global rank) on ``group``, receives posted early.

    gloo moves a message's data only once its receive is posted (the sender waits for the
    receiver's "ready"), so a receive posted late idles the link while the receiver computes.
    The step's first message carries the header (and, when it changed, the metadata); its
    receive is posted as the step starts when the last step's metadata is known (see the
    module doc). As soon as the header has been read, the receives of **every** remaining
    message of the step are posted at once, so a burst of ``k`` sends flows back to back while
    this stage is busy. The buffers cost ``count`` messages of
    memory (one activation or gradient tensor each, small next to the activations a
    micro-batch saves). Messages that carry non-tensor objects each need their own header;
    then the next receive is posted when the previous message has been taken. Received tensors
    are fresh buffers with the sender's ``requires_grad`` (the schedule's backward reads their
    ``.grad``). Under a :class:`TPSlice` each receive fills this rank's piece of the buffer, and
    ``get`` gathers the other pieces from the TP group.
    """

    def __init__(
        self,
        src: int,
        group: dist.ProcessGroup,
        device: torch.device,
        tp: TPSlice | None = None,
    ) -> None:
        self.src, self.group, self.device, self.tp = src, group, device, tp
        self._count = self._taken = self._posted = 0
        self._metadata: P2PMetadata | None = None
        self._header: tuple[dist.Work, torch.Tensor] | None = None
        self._queue: deque[_Posted] = deque()
        self._known: P2PMetadata | None = None
        """The last step's first metadata when its object had tensors only (the sender's
        ``Outbox._known`` mirrors it): the next step's first receives are posted on it."""
        self._early = False
        """Whether this step's first message's receives were posted on ``_known`` at start."""
        self.first_early = False
        """Whether this step's first message used its early receives (metadata unchanged): it
        moved when sent (the step's record says so for the simulator)."""
        self.log = LinkLog()
        """This step's traffic (:meth:`take_log` hands it over and starts a fresh one)."""

    def start(self, count: int) -> None:
        """Begin a step that will receive ``count`` messages: post the first receive now (the
        header, and the tensors of the first message when the last step's metadata is known)."""
        assert self._header is None and not self._queue, "previous step left receives"
        self._count, self._taken, self._posted, self._metadata = count, 0, 0, None
        self.first_early = False
        self._post_header()
        self._early = self._known is not None and count > 0
        if self._early:
            self._metadata = self._known
            self._post_tensors()

    def get(self) -> Any:
        """The next object, waiting only for what has not landed yet."""
        assert self._taken < self._count, "more receives than the step announced"
        asked = time.time()
        start = time.perf_counter()
        if self._header is not None:
            if self._early:  # the data behind the header: wait for it first, so that an
                # emulated link (booked from the post) sees this wait block for the sender
                self._queue[0].wait()
            self._read_metadata()
        assert self._queue and self._metadata is not None
        posted = self._queue.popleft()
        posted.wait()
        # This link's arrival: before the TP gather, which waits for the other links' pieces
        # (each link's time is read on its own: pipeline/link_shares.py).
        landed, blocked = time.time(), time.perf_counter() - start > BLOCKED_S
        for buffer, needs_grad in zip(posted.buffers, posted.requires_grad, strict=True):
            if self.tp is not None:
                self.tp.gather(buffer)
            buffer.requires_grad_(needs_grad)
        self.log.wait_s += time.perf_counter() - start
        self.log.nbytes += sum(_nbytes(p) for p in posted.pieces)
        self.log.times.append(landed if blocked else NOT_BLOCKED)
        self.log.posted.append(posted.at)
        self.log.asked.append(asked)
        meta = self._metadata
        self._taken += 1
        if meta.non_tensor_obj_idx and self._posted < self._count:
            self._post_header()  # objects may change the metadata: one message at a time
        leaves: list[Any] = list(posted.buffers)
        for idx, obj in zip(meta.non_tensor_obj_idx, meta.non_tensor_objs, strict=True):
            leaves.insert(idx, obj)
        return tree_unflatten(leaves, meta.tree_spec)

    def take_log(self) -> LinkLog:
        """This step's log; the box starts a fresh one."""
        log, self.log = self.log, LinkLog()
        return log

    def _post_header(self) -> None:
        header = torch.zeros(1, dtype=torch.int64, device=self.device)
        work = dist.irecv(header, src=self.src, group=self.group)
        assert work is not None
        self._header = (work, header)

    def _read_metadata(self) -> None:
        """Wait for the posted header, read the metadata (unchanged: a header of 0 after the
        early receives), post the tensors' receives."""
        assert self._header is not None
        work, header = self._header
        work.wait()
        self._header = None
        self.log.nbytes += _nbytes(header)
        length, early, self._early = int(header[0]), self._early, False
        if length == 0:
            assert early, "header 0 without early receives"
            self.first_early = True
        else:
            if early:  # posted on the old metadata: the sender filled them with zeros
                filled = self._queue.pop()
                filled.wait()
                self.log.nbytes += sum(_nbytes(p) for p in filled.pieces)
                self._posted -= 1
            payload = torch.empty(length, dtype=torch.uint8, device=self.device)
            dist.irecv(payload, src=self.src, group=self.group).wait()  # type: ignore[union-attr]
            self._metadata = pickle.loads(payload.cpu().numpy().tobytes())
            self.log.nbytes += _nbytes(payload)
        assert self._metadata is not None
        if self._taken == 0:
            self._known = None if self._metadata.non_tensor_obj_idx else self._metadata
        # Tensor-only messages share the first one's metadata: post all of them now.
        last = self._posted + 1 if self._metadata.non_tensor_obj_idx else self._count
        while self._posted < last:
            self._post_tensors()

    def _post_tensors(self) -> None:
        """Post the receives of the next message's tensors (FIFO per link pairs them up)."""
        assert self._metadata is not None
        metas = self._metadata.tensor_metadata
        # requires_grad is set once the buffer is complete (after the TP gather, if any).
        buffers = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
        pieces = [b if self.tp is None else self.tp.piece(b) for b in buffers]
        works = [dist.irecv(p, src=self.src, group=self.group) for p in pieces]
        grads = [bool(m.requires_grad) for m in metas]
        posted = _Posted([w for w in works if w is not None], buffers, pieces, grads, time.time())
        self._queue.append(posted)
        self._posted += 1


@dataclass(slots=True)
class _Posted:
    """One message's posted receives: their works, the buffers they fill (``pieces``: the parts
    received on the link), the buffers' ``requires_grad``, when posted."""

    works: list[dist.Work]
    buffers: list[torch.Tensor]
    pieces: list[torch.Tensor]
    requires_grad: list[bool]
    at: float
    waited: bool = False

    def wait(self) -> None:
        """Wait for the receives once (a gloo receive waited twice waits for another)."""
        if not self.waited:
            for work in self.works:
                work.wait()
            self.waited = True
