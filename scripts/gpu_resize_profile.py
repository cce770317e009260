"""Where ZERO-resizing's kept-subset linear spends its time on a GPU (docs/gpu.md).

Times forward + backward of ``balance.ops.resized_linear`` at a kept fraction against the
full linear, with torch.profiler's per-kernel device time, and times the column gather two
ways: ``index_select`` of single columns (what the op does) and of 64-column blocks (a
coalesced gather: each index moves a contiguous 128-byte run in bf16).
Run on a GPU host: ``python scripts/gpu_resize_profile.py OUT.txt [SHRINK]`` (SHRINK divides
the sizes, for a smoke run on a CPU).
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from colossal_hetero.balance.ops import resized_linear
from colossal_hetero.utils.device import local_device, synchronize


def timed(fn, device, reps=50) -> float:
    for _ in range(5):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / reps * 1e6


def main(out_path: str, shrink: int = 1) -> None:
    device = local_device(0, 1)
    t, h, n, dt = 8192 // shrink, 4096 // shrink, 1024 // shrink, torch.bfloat16
    x = torch.randn(t, h, device=device, dtype=dt, requires_grad=True)
    w = torch.randn(n, h, device=device, dtype=dt, requires_grad=True)
    dy = torch.randn(t, n, device=device, dtype=dt)
    lines = []
    for fraction in (1.0, 0.5, 0.25):
        kept = torch.randperm(h, device=device)[: int(h * fraction)].sort().values
        blocks = torch.randperm(h // 64, device=device)[: int(h * fraction) // 64].sort().values

        def full() -> None:
            torch.nn.functional.linear(x, w).backward(dy)

        def resized(kept=kept) -> None:
            resized_linear(x, w, None, kept).backward(dy)

        def gather_cols(kept=kept) -> None:
            x.detach().index_select(-1, kept)

        def gather_blocks(blocks=blocks) -> None:
            x.detach().view(t, h // 64, 64).index_select(1, blocks)

        def scatter_cols(kept=kept) -> None:
            g = torch.zeros(t, h, device=device, dtype=dt)
            g.index_copy_(1, kept, torch.ones(t, kept.numel(), device=device, dtype=dt))

        fn = full if fraction == 1.0 else resized
        lines.append(
            f"kept {fraction}: fwd+bwd {timed(fn, device):.1f} us; gather columns "
            f"{timed(gather_cols, device):.1f} us, 64-blocks "
            f"{timed(gather_blocks, device):.1f} us; zeros+index_copy columns "
            f"{timed(scatter_cols, device):.1f} us"
        )
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            synchronize(device)
        table = prof.key_averages().table(sort_by="device_time_total", row_limit=12)
        lines.append(table)
    text = "\n".join(lines)
    print(text)
    with open(out_path, "w") as out:
        out.write(text)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
