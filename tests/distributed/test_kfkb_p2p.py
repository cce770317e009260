"""The pipeline's point-to-point boxes on 2 gloo ranks: every receive of a step is posted early.

gloo moves a message only once its receive is posted, so the receives of a burst must be posted
before the receiving stage asks for them. Checked from the boxes' own timestamps (no timing
margins): after the first message is taken, every later message's receive is already posted,
even though the receiver takes the next one only after a pause. Also: the values, their
``requires_grad``, the bytes both sides account, and a second step whose messages carry
non-tensor objects (one header each, posted one at a time).

Then the first message without rendezvous: after a tensor-only step, the next step's first
receive is posted as the step starts, before the sender sends (from both sides' timestamps),
and its header is 0 (8 bytes: no payload on the wire); a step whose shapes changed sends
zeros into those early receives, then the new metadata, and its values still arrive intact;
a step with non-tensor objects after a tensor-only one takes the same way.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from colossal_hetero.pipeline.p2p import Inbox, Outbox
from tests.dist_utils import run_distributed

COUNT, WIDTH = 4, 4096


def _message(i: int, with_object: bool = False) -> dict:
    h = torch.full((2, WIDTH), float(i), requires_grad=True)
    return {"hidden_states": h, "tag": i} if with_object else {"hidden_states": h}


EARLY = ((False, 2, 2), (False, 2, 2), (False, 2, 3), (True, 2, 3))
"""Steps after the first two: (objects, count, rows) each; the second, third and fourth find
early receives (the third with new shapes, the fourth with objects)."""


def _message_rows(i: int, rows: int, with_object: bool) -> dict:
    h = torch.full((rows, WIDTH), float(i) + rows, requires_grad=True)
    return {"hidden_states": h, "tag": i} if with_object else {"hidden_states": h}


def _run(rank, world_size, device):
    group = dist.new_group([0, 1])
    if rank == 0:
        out = Outbox(1, group, device)
        for with_object, count in ((False, COUNT), (True, 2)):
            for i in range(count):
                out.send(_message(i, with_object))
            out.finish()
            sent = out.take_log()
            dist.broadcast_object_list([sent.nbytes], src=0)
        for with_object, count, rows in EARLY:
            dist.barrier()  # the receiver's step has started
            for i in range(count):
                out.send(_message_rows(i, rows, with_object))
            out.finish()
            sent = out.take_log()
            dist.broadcast_object_list([sent.nbytes, sent.times], src=0)
        return
    inbox = Inbox(0, group, device)
    inbox.start(COUNT)
    got = [inbox.get()]
    first_taken = time.time()
    time.sleep(0.2)  # the stage computes; the later messages' receives must already be posted
    got += [inbox.get() for _ in range(COUNT - 1)]
    log = inbox.take_log()
    assert len(log.posted) == COUNT
    assert all(t <= first_taken for t in log.posted), (log.posted, first_taken)
    for i, obj in enumerate(got):
        assert torch.equal(obj["hidden_states"], torch.full((2, WIDTH), float(i)))
        assert obj["hidden_states"].requires_grad
    sent_bytes = [None]
    dist.broadcast_object_list(sent_bytes, src=0)
    assert log.nbytes == sent_bytes[0]
    # Messages with non-tensor leaves: a header each, the next posted when one is taken.
    inbox.start(2)
    objs = [inbox.get(), inbox.get()]
    assert [o["tag"] for o in objs] == [0, 1]
    assert torch.equal(objs[1]["hidden_states"], torch.full((2, WIDTH), 1.0))
    log = inbox.take_log()
    dist.broadcast_object_list(sent_bytes, src=0)
    assert log.nbytes == sent_bytes[0] and len(log.posted) == 2
    _early_steps(inbox)


def _early_steps(inbox: Inbox) -> None:
    header = 8  # int64[1]
    tensor_only_bytes = None
    for n, (with_object, count, rows) in enumerate(EARLY):
        inbox.start(count)
        started = time.time()
        dist.barrier()  # the sender starts sending only now
        time.sleep(0.05)
        got = [inbox.get() for _ in range(count)]
        log = inbox.take_log()
        sent: list = [None, None]
        dist.broadcast_object_list(sent, src=0)
        nbytes, sent_times = sent
        assert log.nbytes == nbytes, (n, log.nbytes, nbytes)
        for i, obj in enumerate(got):
            assert torch.equal(obj["hidden_states"], torch.full((rows, WIDTH), float(i) + rows))
            assert obj["hidden_states"].requires_grad
            assert not with_object or obj["tag"] == i
        payload = count * rows * WIDTH * 4
        if n == 0:  # the step before had objects: no early receive, metadata sent
            assert log.posted[0] > started and nbytes > header + payload
            tensor_only_bytes = nbytes
        elif n == 1:  # same metadata: posted before the sender sent; header 0, no payload
            assert log.posted[0] <= started < sent_times[0], (log.posted, started, sent_times)
            assert nbytes == header + payload < tensor_only_bytes
        else:  # new shapes / objects: the early receive took zeros of the old shapes, and
            # the first message's own receive was posted once its metadata was read
            old_rows = EARLY[n - 1][2]
            assert log.posted[0] > started
            assert nbytes > header + payload + old_rows * WIDTH * 4


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_every_receive_of_a_step_is_posted_before_it_is_asked_for():
    run_distributed(_run, world_size=2)
