"""The ``colossal-hetero`` command.

colossal-hetero check CONFIG [--world-size N]   validate a run config without launching
colossal-hetero train CONFIG [--nproc N]        launch `python -m colossal_hetero.train` on
                                                this machine through torchrun (or on shaped
                                                links: emulation.network.mode shaped)
colossal-hetero demo [--steps N] [--out DIR]    stock vs planned TP=2, one rank 4x slower
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from colossal_hetero.bench import BENCHMARKS
from colossal_hetero.config import ConfigError, RunConfig, load_config
from colossal_hetero.preflight import validate_run


def _world_size_of(config: RunConfig) -> int:
    """The world size a config implies: its device list, or tp * pp * dp."""
    if config.cluster.devices:
        return len(config.cluster.devices)
    p = config.parallel
    return p.tp * p.pp * max(p.dp, 1)


def launch_command(config_path: str | Path, nproc: int) -> list[str]:
    """The torchrun command line that trains ``config_path`` on ``nproc`` local ranks."""
    return [
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


def launch(config_path: str | Path, nproc: int) -> int:
    """Run the trainer on ``nproc`` local ranks with torchrun; returns its exit status."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.call(launch_command(config_path, nproc), env=env)


def _check(args: argparse.Namespace) -> int:
    from colossal_hetero.train import preflight

    world_size = args.world_size or _world_size_of(load_config(args.config))
    # Every check a launch makes before its first collective, the plan included.
    config, _ = preflight(args.config, world_size, world_size)
    p = config.parallel
    dp = world_size // (p.tp * p.pp)
    experts = f" (experts over ep {p.ep})" if p.ep > 1 else ""
    layout = f"tp {p.tp} x pp {p.pp} x dp {dp}{experts}"
    print(f"ok: {config.model.arch}, world size {world_size} = {layout}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from colossal_hetero.train import preflight

    nproc = args.nproc or _world_size_of(load_config(args.config))
    preflight(args.config, nproc, nproc)  # refuse here, before torchrun starts any rank
    config = load_config(args.config)
    if config.emulation.network.mode == "shaped":  # ranks in namespaces behind tc links
        from colossal_hetero.emulation.shaped.launcher import launch_training

        return launch_training(config, args.config, nproc)
    return launch(args.config, nproc)


def _plan(args: argparse.Namespace) -> int:
    import time

    from colossal_hetero.planner.plan import dump_plan, format_plan
    from colossal_hetero.planner.resolve import (
        check_plan,
        compare_layouts,
        plan_run,
        resolve_plan,
    )
    from colossal_hetero.preflight import validate_launch

    config = load_config(args.config)
    world_size = args.world_size or _world_size_of(config)
    validate_launch(config, world_size, world_size)
    if config.plan.mode == "file":
        raise ConfigError("plan.mode: is file; `plan` makes a plan, set mode auto or even")
    if config.parallel.pp > 1:  # pipeline stages: the plugin plans them the same at configure
        from colossal_hetero.planner.resolve import (
            stage_plan_run,
            stage_widths_run,
            wants_stage_widths,
        )
        from colossal_hetero.planner.stage_plan import format_stage_plan

        stages = stage_plan_run(config, world_size)
        print(format_stage_plan(stages))
        if wants_stage_widths(config.plugin_config()):  # each stage's TP group plans its own
            plans = stage_widths_run(
                config, world_size, list(stages.layers_per_stage), stages.num_microbatches
            )
            for stage, stage_plan in enumerate(plans):
                print(f"  stage {stage} TP widths    {stage_plan.widths}")
        print("batch shares stay even under pipeline parallelism")
        return 0
    # Plan even for identical devices: the table still shows the predicted times.
    auto = dataclasses.replace(config, plan=dataclasses.replace(config.plan, mode="auto"))
    started = time.perf_counter()
    plan = resolve_plan(auto, world_size) or plan_run(auto, world_size)
    check_plan(plan, config.plugin_config(), world_size, config.data.global_batch_size)
    print(format_plan(plan))
    print(f"planned in {time.perf_counter() - started:.2f} s")
    if config.parallel.pp == 1 and world_size > 1:
        print(_format_layouts(compare_layouts(auto, world_size, validate_run), config.parallel.tp))
    if config.parallel.tp > 1:  # 1D against 2D tensor parallelism, and tp_mode auto's pick
        from colossal_hetero.planner.tp2d_choice import choose_for_config, format_choice

        mode = getattr(config.parallel, "tp_mode", "1d")
        print(format_choice(choose_for_config(config, world_size), mode))
    if args.out:
        dump_plan(plan, args.out)
        print(f"wrote {args.out}; train with plan: {{mode: file, path: {args.out}}}")
    return 0


def _format_layouts(options: list, current_tp: int) -> str:
    """The other layouts of the same ranks, predicted (``compare_layouts``)."""
    lines = ["", "the same ranks in other layouts (predicted step, planned):"]
    for option in options:
        name = f"tp {option.tp} x dp {option.dp}"
        if option.step_time is None:
            what = f"cannot run: {option.reason}"
        else:
            what = f"{option.step_time * 1e3:10.2f} ms"
        mark = "   <- this config" if option.tp == current_tp else ""
        lines.append(f"  {name:<14} {what}{mark}")
    return "\n".join(lines)


def _profile(args: argparse.Namespace) -> int:
    import yaml

    from colossal_hetero.bench.profile import cluster_yaml, profile_ranks
    from colossal_hetero.utils.device import detected_device_kind

    emulation, run = None, None
    if args.config:
        run = load_config(args.config)
        validate_run(run, args.nproc)
        emulation = run.emulation if run.emulation.enabled else None
    results = profile_ranks(args.nproc, emulation, run)  # on shaped links if the run says so
    for rank, result in enumerate(results):
        gflops, gbps = result["flops"] / 1e9, result["gbps"]
        print(f"rank {rank}: {gflops:8.2f} GFLOP/s  all-reduce {gbps:.2f} Gbit/s")
    fragment = yaml.safe_dump(cluster_yaml(results, detected_device_kind(args.nproc)))
    print(fragment, end="")
    if args.out:
        Path(args.out).write_text(fragment)
        print(f"wrote {args.out} (merge it into a run config)")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from colossal_hetero.bench import run_benchmark

    return run_benchmark(
        args.name, quick=args.quick, json_path=args.json, only=args.only, network=args.network
    )


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

    plan = commands.add_parser("plan", help="plan uneven widths and batch shares")
    plan.add_argument("config")
    plan.add_argument("--world-size", type=int, default=0)
    plan.add_argument("--out", default="", help="write the plan here (.yaml or .json)")
    plan.set_defaults(handler=_plan)

    profile = commands.add_parser("profile", help="measure device speed and link bandwidth")
    profile.add_argument("--nproc", type=int, default=2, help="local ranks to measure")
    profile.add_argument("--config", default="", help="apply this run config's emulation")
    profile.add_argument("--out", default="", help="write the cluster YAML fragment here")
    profile.set_defaults(handler=_profile)

    bench = commands.add_parser("bench", help="run a benchmark against stock Colossal-AI")
    bench.add_argument("name", choices=list(BENCHMARKS))
    bench.add_argument("--quick", action="store_true", help="fewer cases and steps")
    bench.add_argument("--json", default="", help="write results here")
    bench.add_argument(
        "--only", default="", metavar="TEXT", help="run only the cases whose name contains TEXT"
    )
    bench.add_argument(
        "--network",
        choices=["model", "shaped"],
        default=None,
        help="static and pipeline: model or real tc-shaped links (root); default: static the "
        "model, pipeline shaped where it can build them",
    )
    bench.set_defaults(handler=_bench)

    demo = commands.add_parser("demo", help="stock vs planned TP=2, one rank 4x slower")
    demo.add_argument("--steps", type=int, default=0, help="override the demo's step count")
    demo.add_argument("--out", default="runs/demo", help="output folder")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``colossal-hetero`` console script."""
    from colossal_hetero.train import error_line
    from colossal_hetero.utils.quiet import no_idle_compile_workers, quiet_third_party_warnings

    args = build_parser().parse_args(argv)
    quiet_third_party_warnings(pipeline=True)
    no_idle_compile_workers()
    try:
        return int(args.handler(args))
    except ConfigError as error:
        print(error_line(error), file=sys.stderr)
        return 2
    except FileNotFoundError as error:
        print(f"colossal-hetero: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
