"""bench/pipeline_stretch.py's ``dedicated`` accounting on fake clocks: every sleep it takes is
checked against hand-computed seconds (factor 2, base 2.5). No timing, no process group."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from colossal_hetero.bench.pipeline_stretch import Stretch


class FakeClocks:
    """Wall and CPU clocks advanced by hand; ``sleep`` advances the wall clock alone."""

    def __init__(self) -> None:
        self.wall = 100.0
        self.cpu = 5.0
        self.slept: list[float] = []

    def compute(self, cpu: float, wall: float) -> None:
        self.cpu += cpu
        self.wall += wall

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.wall += seconds


def _collectives(clocks: FakeClocks, wait: float) -> SimpleNamespace:
    """A stand-in for torch.distributed: each call waits ``wait`` s of wall (the partner)."""

    def finish() -> bool:
        clocks.compute(0.0, wait)
        return True

    def all_reduce(tensor: Any = None, group: Any = None, async_op: bool = False) -> Any:
        if async_op:
            return SimpleNamespace(wait=finish, tag="work")
        finish()
        return None

    return SimpleNamespace(all_reduce=all_reduce)


def _stretch(
    clocks: FakeClocks, fake: Any, factor: float = 2.0, median_work: bool = False
) -> Stretch:
    stretch = Stretch(
        factor,
        clocks.sleep,
        mode="dedicated",
        base=2.5,
        cpu_clock=lambda: clocks.cpu,
        wall_clock=lambda: clocks.wall,
        sync_modules=[fake],
        median_work=median_work,
    )
    stretch.enabled = True
    return stretch


def test_each_interval_between_collectives_is_stretched_on_its_own():
    clocks = FakeClocks()
    fake = _collectives(clocks, wait=1.0)
    original = fake.all_reduce
    stretch = _stretch(clocks, fake)
    stretch.begin_pass()
    assert fake.all_reduce is not original  # wrapped while the pass is open
    clocks.compute(cpu=0.1, wall=0.1)
    fake.all_reduce("x")
    clocks.compute(cpu=0.2, wall=0.3)
    stretch.end_pass()
    assert fake.all_reduce is original  # and restored after it
    # Interval 1: max(0, 2.5*0.1 - 0.1) + (2-1)*2.5*0.1 = 0.15 + 0.25 = 0.4, slept BEFORE the
    # collective (the partner waits for it there). The collective's 1.0 s wait is no compute.
    # Interval 2: max(0, 2.5*0.2 - 0.3) + 2.5*0.2 = 0.2 + 0.5 = 0.7.
    assert clocks.slept == pytest.approx([0.4, 0.7])
    # Stretched at the pass's end alone it would have slept max(0, 0.75 - 1.4) + 0.75 = 0.75
    # on top of the wait: the wait would have hidden the full-speed device's base padding.
    assert stretch.slept_s == pytest.approx(1.1)
    assert stretch.passes == 1 and stretch.intervals == 2
    assert (stretch.cpu_s, stretch.compute_wall_s) == pytest.approx((0.3, 0.4))
    assert stretch.passes_s == pytest.approx(0.1 + 0.4 + 1.0 + 0.3 + 0.7)  # the whole pass
    fake.all_reduce("x")  # outside a pass: a plain call, nothing stretched
    assert clocks.slept == pytest.approx([0.4, 0.7])
    stretch.begin_pass()
    wrapper = fake.all_reduce
    stretch.end_pass()
    stretch.begin_pass()
    assert fake.all_reduce is wrapper  # made once, reused by every pass
    stretch.end_pass()


def test_async_work_waits_end_intervals_and_full_speed_pads_to_base():
    clocks = FakeClocks()
    fake = _collectives(clocks, wait=0.5)
    stretch = _stretch(clocks, fake, factor=1.0)  # a full-speed device: base padding only
    stretch.begin_pass()
    clocks.compute(cpu=0.2, wall=0.2)
    work = fake.all_reduce("x", async_op=True)  # interval 1: 2.5*0.2 - 0.2 = 0.3
    assert work.tag == "work"  # other attributes are the real work's
    clocks.compute(cpu=0.1, wall=0.4)  # overlapped compute; contention made it slower than 0.25
    assert work.wait() is True  # interval 2: max(0, 0.25 - 0.4) + 0 = 0: no sleep
    clocks.compute(cpu=0.04, wall=0.04)
    stretch.end_pass()  # interval 3: 0.1 - 0.04 = 0.06
    assert clocks.slept == pytest.approx([0.3, 0.06])
    assert stretch.intervals == 3 and stretch.passes == 1


def test_disabled_or_added_mode_never_wraps_collectives():
    clocks = FakeClocks()
    fake = _collectives(clocks, wait=1.0)
    original = fake.all_reduce
    stretch = _stretch(clocks, fake)
    stretch.enabled = False
    stretch.begin_pass()
    assert fake.all_reduce is original and not stretch.in_pass
    added = Stretch(3.0, clocks.sleep, wall_clock=lambda: clocks.wall, sync_modules=[fake])
    added.enabled = True
    added.begin_pass()
    assert fake.all_reduce is original  # one interval per pass: (3-1) x its wall time
    clocks.compute(cpu=0.1, wall=0.2)
    fake.all_reduce("x")
    added.end_pass()
    assert clocks.slept == pytest.approx([2 * 1.2])
    with pytest.raises(ValueError, match="factor, base"):
        Stretch(2.0, mode="dedicated", base=0.5)


class _ReduceBoth(torch.autograd.Function):
    """Identity whose forward and backward each call the fake all-reduce (a TP block's syncs)
    and advance the fake clocks by a fixed compute."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, env: Any) -> torch.Tensor:
        ctx.env = env
        env.clocks.compute(cpu=0.1, wall=0.1)
        env.fake.all_reduce(x)
        env.clocks.compute(cpu=0.1, wall=0.1)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        env = ctx.env
        env.clocks.compute(cpu=0.2, wall=0.2)
        env.fake.all_reduce(grad)
        env.clocks.compute(cpu=0.2, wall=0.2)
        return grad.clone(), None


class _Block(torch.nn.Module):
    def __init__(self, env: Any) -> None:
        super().__init__()
        self.env = env
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        return (_ReduceBoth.apply(hidden, self.env) * self.scale,)


def test_blocks_forward_and_backward_are_cut_at_their_collectives():
    clocks = FakeClocks()
    fake = _collectives(clocks, wait=1.0)
    env = SimpleNamespace(clocks=clocks, fake=fake)
    blocks = [_Block(env), _Block(env)]
    stretch = _stretch(clocks, fake)
    stretch.attach(blocks)
    x = torch.ones(3, requires_grad=True)
    h = x
    for block in blocks:
        h = block(h)[0]
    h.sum().backward()
    stretch.detach()
    assert x.grad is not None and torch.equal(x.grad, torch.full((3,), 4.0))  # gradients untouched
    # Forward intervals of 0.1 s CPU in 0.1 s wall: 0.15 + 0.25 = 0.4 each; backward ones of
    # 0.2 in 0.2: 0.3 + 0.5 = 0.8 each. Two blocks, two intervals per pass.
    assert clocks.slept == pytest.approx([0.4] * 4 + [0.8] * 4)
    assert stretch.passes == 4 and stretch.intervals == 8
    assert not stretch.in_pass


def test_a_block_whose_input_needs_no_gradient_opens_no_backward():
    clocks = FakeClocks()
    fake = _collectives(clocks, wait=1.0)
    env = SimpleNamespace(clocks=clocks, fake=fake)
    block = _Block(env)
    stretch = _stretch(clocks, fake)
    stretch.attach([block])
    out = block(torch.ones(3))[0]  # the forward pass: stretched (2 intervals)
    out.sum().backward()  # no end mark on the input: no backward pass opened
    assert stretch.passes == 1 and clocks.slept == pytest.approx([0.4, 0.4])
    assert not stretch.in_pass and block.scale.grad is not None


def test_set_device_changes_the_emulated_device_from_the_next_pass():
    """bench pipeline's phases: (a)/(b) on full-speed devices 2.5x slower than a core, then (c)
    on devices 6x slower, the slowed rank's at half speed; one stretch, reconfigured."""
    clocks = FakeClocks()
    stretch = _stretch(clocks, _collectives(clocks, wait=0.0), factor=1.0)
    for factor, base in ((1.0, 2.5), (2.0, 6.0), (1.0, 6.0)):
        stretch.set_device(factor, base)
        stretch.begin_pass()
        clocks.compute(cpu=0.1, wall=0.15)
        stretch.end_pass()
    # (1, 2.5): 0.25 - 0.15 = 0.1; (2, 6): 0.6 - 0.15 + 0.6 = 1.05; (1, 6): 0.45.
    assert clocks.slept == pytest.approx([0.1, 1.05, 0.45])
    for bad in ((0.5, 2.5), (1.0, 0.9)):
        with pytest.raises(ValueError, match="factor, base"):
            stretch.set_device(*bad)
    assert (stretch.factor, stretch.base) == (1.0, 6.0)  # a refused device changes nothing


def _median(clocks: FakeClocks, fake: Any, factor: float = 1.0) -> Stretch:
    return _stretch(clocks, fake, factor, median_work=True)


def test_median_work_stretches_each_interval_by_its_median_cpu_so_far():
    """The same interval of the same pass, measured again on a drifting host, is stretched by
    the median CPU time it took so far; other positions, directions and blocks keep their own."""
    clocks = FakeClocks()
    fake = _collectives(clocks, wait=0.0)
    stretch = _median(clocks, fake, factor=2.0)
    key = (7, False)
    for cpu_first in (0.1, 0.3, 0.14, 0.12):  # the host slows, then recovers
        stretch.begin_pass(key)
        clocks.compute(cpu=cpu_first, wall=cpu_first)
        fake.all_reduce("x")
        clocks.compute(cpu=0.2, wall=0.2)
        stretch.end_pass()
    # Position 0's medians so far: 0.1; (0.1 + 0.3) / 2 = 0.2; 0.14; (0.12 + 0.14) / 2 = 0.13.
    # Dedicated at factor 2, base 2.5, wall = cpu: sleep = max(0, 2.5 w - wall) + 2.5 w.
    works, walls = (0.1, 0.2, 0.14, 0.13), (0.1, 0.3, 0.14, 0.12)
    first = [max(0.0, 2.5 * w - c) + 2.5 * w for w, c in zip(works, walls, strict=True)]
    assert clocks.slept[0::2] == pytest.approx(first)
    assert clocks.slept[1::2] == pytest.approx([2.5 * 0.2 - 0.2 + 0.5] * 4)  # position 1
    assert stretch.cpu_s == pytest.approx(0.66 + 0.8)
    assert stretch.work_s == pytest.approx(sum(works) + 0.8)  # the CPU seconds stretched by
    # Another direction of the block, another block, and a pass opened without a key start
    # from their own CPU time.
    for other in ((7, True), (8, False), None):
        stretch.begin_pass(other)
        clocks.compute(cpu=0.3, wall=0.3)
        stretch.end_pass()
        assert clocks.slept[-1] == pytest.approx(2.5 * 0.3 - 0.3 + 0.75)


def test_median_work_is_off_by_default_and_keys_blocks_forward_and_backward():
    clocks = FakeClocks()
    fake = _collectives(clocks, wait=1.0)
    plain = _stretch(clocks, fake, factor=1.0)
    for cpu in (0.1, 0.2):
        plain.begin_pass((0, False))
        clocks.compute(cpu=cpu, wall=cpu)
        plain.end_pass()
    assert clocks.slept == pytest.approx([0.15, 0.3])  # each pass its own CPU time
    assert Stretch(2.0, median_work=True).median_work is False  # ``added``: wall time only
    # Through real blocks: each block's forward and backward passes get their own keys, so the
    # third of three steps (1x, 1x, then 3x the CPU on a slow host) is stretched interval by
    # interval by the median, the first steps' CPU time.
    env = SimpleNamespace(clocks=clocks, fake=fake)
    blocks = [_Block(env), _Block(env)]
    stretch = _median(clocks, fake, factor=2.0)
    stretch.attach(blocks)
    slept = []
    for slow in (1.0, 1.0, 3.0):
        clocks.slept.clear()
        env.clocks = SimpleNamespace(
            compute=lambda cpu, wall, s=slow: clocks.compute(cpu * s, wall * s)
        )
        h = torch.ones(3, requires_grad=True)
        for block in blocks:
            h = block(h)[0]
        h.sum().backward()
        slept.append(list(clocks.slept))
    stretch.detach()
    # Steps 1-2 (wall = cpu, factor 2): forward intervals of 0.1 -> (0.25 - 0.1) + 0.25 = 0.4,
    # backward ones of 0.2 -> (0.5 - 0.2) + 0.5 = 0.8.
    assert slept[0] == slept[1] == pytest.approx([0.4] * 4 + [0.8] * 4)
    # Step 3: the work is the median of (w, w, 3w) = w, the wall 3x: max(0, 0.25 - 0.3) + 0.25
    # forward, max(0, 0.5 - 0.6) + 0.5 backward. By its own CPU time: 1.2 and 2.4.
    assert slept[2] == pytest.approx([0.25] * 4 + [0.5] * 4)
    assert stretch.work_s == pytest.approx(3 * (4 * 0.1 + 4 * 0.2))


def test_another_device_starts_the_median_afresh():
    """Phase (c)'s device after phase (a)'s: the block's samples of (a) no longer count; the
    same device set again keeps them."""
    clocks = FakeClocks()
    stretch = _median(clocks, _collectives(clocks, wait=0.0), factor=1.0)
    for cpu, device in ((0.1, (1.0, 2.5)), (0.1, (1.0, 2.5)), (0.2, (2.0, 6.0)), (0.3, (2.0, 6.0))):
        stretch.set_device(*device)
        stretch.begin_pass((0, False))
        clocks.compute(cpu=cpu, wall=cpu)
        stretch.end_pass()
    # (1, 2.5): 2.5*0.1 - 0.1 = 0.15 twice; (2, 6) afresh: 0.2 alone -> (1.2 - 0.2) + 1.2 = 2.2;
    # then the median of (0.2, 0.3) = 0.25 -> (1.5 - 0.3) + 1.5 = 2.7 (with (a)'s two 0.1
    # samples the median would have been 0.15).
    assert clocks.slept == pytest.approx([0.15, 0.15, 2.2, 2.7])


def test_blocks_of_one_kind_share_their_samples_across_model_copies():
    """Two variants' copies of the same block (same classes, same shapes) are one kind of work;
    a block of other widths is another."""
    from colossal_hetero.bench.pipeline_stretch import work_signature

    env = SimpleNamespace(clocks=None, fake=None)
    same = [_Block(env), _Block(env)]
    wider = torch.nn.Linear(4, 8)
    assert work_signature(same[0]) == work_signature(same[1])
    assert work_signature(torch.nn.Linear(4, 4)) != work_signature(wider)
    clocks = FakeClocks()
    stretch = _median(clocks, _collectives(clocks, wait=0.0), factor=1.0)
    stretch.attach([*same, wider])
    keys = [block._stretch_serial for block in (*same, wider)]  # type: ignore[attr-defined]
    assert keys[0] == keys[1] != keys[2]
    # The first copy's pass at 0.1 s CPU, then the second copy's at 0.3: its median is 0.2.
    for block, cpu in ((same[0], 0.1), (same[1], 0.3)):
        stretch.begin_pass((block._stretch_serial, False))  # type: ignore[attr-defined]
        clocks.compute(cpu=cpu, wall=cpu)
        stretch.end_pass()
    assert clocks.slept == pytest.approx([2.5 * 0.1 - 0.1, 2.5 * 0.2 - 0.3])
    assert stretch.work_s == pytest.approx(0.1 + 0.2)
    stretch.detach()
