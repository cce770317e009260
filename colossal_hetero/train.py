"""Entry point: ``colossalai run --nproc_per_node N -m colossal_hetero.train --config X.yaml``.

Also works under plain ``torchrun``. Configuration errors are reported as one line on every
rank, before any collective starts, and the process exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from colossal_hetero.config import ConfigError, load_config, validate_run
from colossal_hetero.planner.resolve import resolve_plan, unplanned_notice
from colossal_hetero.utils.quiet import quiet_optional_kernel_warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="colossal_hetero.train", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML run configuration")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config = load_config(args.config)
        validate_run(config, world_size)
        plan = resolve_plan(config, world_size)  # identical on every rank
    except (ConfigError, FileNotFoundError) as error:
        print(f"[rank {rank}] colossal-hetero: config error: {error}", file=sys.stderr)
        return 2
    notice = unplanned_notice(config.plugin_config())
    if notice and rank == 0:
        print(f"colossal-hetero: {notice}", file=sys.stderr)

    quiet_optional_kernel_warnings()
    import torch.distributed as dist

    from colossal_hetero.plugin import init_distributed
    from colossal_hetero.training.trainer import run_training

    device = init_distributed(config.cluster, seed=config.train.seed)
    try:
        result = run_training(config, device, plan)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        curve = ", ".join(f"{step + 1}: {loss:.4f}" for step, loss in result.val_losses)
        print(f"validation loss by step: {curve}")
        if result.val_accuracy is not None:
            print(f"validation accuracy: {result.val_accuracy:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
