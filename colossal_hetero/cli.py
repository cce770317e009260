"""The ``colossal-hetero`` command.

colossal-hetero check CONFIG [--world-size N]   validate a run config without launching
colossal-hetero train CONFIG [--nproc N]        launch `python -m colossal_hetero.train` on
                                                this machine through torchrun
colossal-hetero demo [--steps N] [--out DIR]    4 CPU ranks, one emulated 2x slower
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from colossal_hetero.config import ConfigError, RunConfig, load_config, validate_run


def _world_size_of(config: RunConfig) -> int:
    """The world size a config implies: its device list, or tp * pp * dp."""
    if config.cluster.devices:
        return len(config.cluster.devices)
    p = config.parallel
    return p.tp * p.pp * max(p.dp, 1)


def launch(config_path: str | Path, nproc: int, extra_env: dict[str, str] | None = None) -> int:
    """Run the trainer on ``nproc`` local ranks with torchrun; returns its exit status."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "colossal_hetero.train",
        "--config",
        str(config_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    return subprocess.call(command, env=env)


def _check(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    world_size = args.world_size or _world_size_of(config)
    dp = validate_run(config, world_size)
    p = config.parallel
    print(f"ok: {config.model.arch}, world size {world_size} = tp {p.tp} x pp {p.pp} x dp {dp}")
    return 0


def _train(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    nproc = args.nproc or _world_size_of(config)
    validate_run(config, nproc)
    return launch(args.config, nproc)


def _demo(args: argparse.Namespace) -> int:
    from colossal_hetero.demo import run_demo

    return run_demo(steps=args.steps, out_dir=Path(args.out))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``colossal-hetero`` command."""
    parser = argparse.ArgumentParser(
        prog="colossal-hetero",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    check = commands.add_parser("check", help="validate a run config")
    check.add_argument("config")
    check.add_argument("--world-size", type=int, default=0)
    check.set_defaults(handler=_check)

    train = commands.add_parser("train", help="train from a YAML config on this machine")
    train.add_argument("config")
    train.add_argument("--nproc", type=int, default=0, help="ranks (default: from the config)")
    train.set_defaults(handler=_train)

    demo = commands.add_parser("demo", help="4 CPU ranks, one emulated 2x slower")
    demo.add_argument("--steps", type=int, default=0, help="override the demo's step count")
    demo.add_argument("--out", default="runs/demo", help="output folder")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``colossal-hetero`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except (ConfigError, FileNotFoundError) as error:
        print(f"colossal-hetero: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
