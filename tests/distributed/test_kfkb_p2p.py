"""The pipeline's point-to-point boxes on 2 gloo ranks: every receive of a step is posted early.

gloo moves a message only once its receive is posted, so the receives of a burst must be posted
before the receiving stage asks for them. Checked from the boxes' own timestamps (no timing
margins): after the first message is taken, every later message's receive is already posted,
even though the receiver takes the next one only after a pause. Also: the values, their
``requires_grad``, the bytes both sides account, and a second step whose messages carry
non-tensor objects (one header each, posted one at a time).
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


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_every_receive_of_a_step_is_posted_before_it_is_asked_for():
    run_distributed(_run, world_size=2)
