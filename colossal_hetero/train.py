"""Entry point: ``colossalai run --nproc_per_node N -m colossal_hetero.train --config X.yaml``.

Also works under plain ``torchrun``. Configuration errors are reported as one line on every
rank, before any collective starts, and the process exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap
from pathlib import Path

from colossal_hetero.config import ConfigError, RunConfig, load_config
from colossal_hetero.config.loader import read_yaml
from colossal_hetero.planner.plan import Plan
from colossal_hetero.planner.resolve import resolve_plan, unplanned_notice
from colossal_hetero.preflight import validate_launch
from colossal_hetero.utils.quiet import no_idle_compile_workers, quiet_third_party_warnings


def preflight(
    config_path: str | Path, world_size: int, local_world_size: int
) -> tuple[RunConfig, Plan | None]:
    """Every check a launch makes before its first collective, and the plan it will run.

    Loads the YAML strictly, validates the run against the world size (model shape from the
    transformers config, no weights; memory of identical devices), the device kind on this
    host and the output folders, then resolves the plan (reading a plan file, or planning).
    Pure and deterministic: every rank gets the same result. ``colossal-hetero check``,
    ``plan`` and ``train`` call it too, so each entry point reports the same line.

    Raises:
        ConfigError: one line naming the field (or the file).
    """
    config = with_tp_mode_resolved(load_config(config_path), world_size)
    validate_launch(config, world_size, local_world_size)
    plan_path = config.plan.path
    if config.plan.mode == "file" and plan_path is not None and Path(plan_path).is_file():
        if Path(plan_path).suffix != ".json":  # JSON plans are parsed (and refused) as JSON
            try:
                read_yaml(plan_path)
            except ConfigError as error:
                raise ConfigError(f"plan.path: {error}") from None
    return config, resolve_plan(config, world_size)


def with_tp_mode_resolved(config: RunConfig, world_size: int) -> RunConfig:
    """``parallel.tp_mode: auto`` replaced by the planner's pick (1d or 2d; the pick that
    ``colossal-hetero plan`` prints), pure and the same on every rank; other modes as given."""
    if config.parallel.tp_mode != "auto":
        return config
    from colossal_hetero.planner.tp2d_choice import resolved_tp_mode

    mode = resolved_tp_mode(config, world_size)
    return dataclasses.replace(
        config,
        parallel=dataclasses.replace(config.parallel, tp_mode=mode),  # type: ignore[arg-type]
    )


def error_line(error: BaseException, rank: int | None = None) -> str:
    """The one line a configuration error prints (with the rank under a launcher)."""
    where = "" if rank is None else f"[rank {rank}] "
    return f"{where}colossal-hetero: config error: {' '.join(str(error).split())}"


def _await_peers(world_size: int, deadline_s: float = 30.0) -> None:
    """Under torchrun, return once every rank has printed its configuration error.

    torchrun stops every worker as soon as one exits non-zero, which could kill a slower rank
    before it prints. Ranks run the same checks, so each one counts itself on the launcher's
    key-value store (MASTER_ADDR:MASTER_PORT; no process group exists and none is made) and
    waits for the others. Gives up after ``deadline_s``: a rank whose checks passed never
    counts itself, and it is then stopped by torchrun when this one exits.
    """
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world_size < 2 or not addr or not port:
        return
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    key = f"colossal_hetero/config_error/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT')}"
    deadline = time.monotonic() + deadline_s
    try:
        store = TCPStore(
            addr,
            int(port),
            is_master=False,
            timeout=timedelta(seconds=deadline_s),
            wait_for_workers=False,
        )
        store.add(key, 1)
        while store.add(key, 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
    except (RuntimeError, OSError, ValueError):  # no store to reach: exit at once
        return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="colossal_hetero.train", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML run configuration")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    quiet_third_party_warnings(pipeline=True)  # before transformers and colossalai import
    no_idle_compile_workers()
    try:
        config, plan = preflight(args.config, world_size, local_world_size)
    except ConfigError as error:
        # One write per line: ranks share the terminal, and a separate newline interleaves.
        sys.stderr.write(error_line(error, rank) + "\n")
        sys.stderr.flush()
        _await_peers(world_size)
        return 2
    quiet_third_party_warnings(pipeline=config.parallel.pp > 1)
    notice = unplanned_notice(config.plugin_config())
    if notice and rank == 0:
        print(wrap(f"colossal-hetero: {notice}"), file=sys.stderr)

    from colossal_hetero.plugin import init_distributed
    from colossal_hetero.training.trainer import run_training
    from colossal_hetero.utils.teardown import close_process_group

    device = init_distributed(config.cluster, seed=config.train.seed)
    try:
        result = run_training(config, device, plan)
    except ConfigError as error:  # found by the plugin at configure: same on every rank
        sys.stderr.write(error_line(error, rank) + "\n")
        return 2
    finally:
        close_process_group()
    if rank == 0:
        print(format_results(result.val_losses, result.val_accuracy))
    return 0


def wrap(text: str, width: int = 80) -> str:
    """``text`` broken into lines of at most ``width`` columns (an 80-column terminal),
    continuation lines indented."""
    return textwrap.fill(text, width=width, subsequent_indent="  ", break_on_hyphens=False)


def format_results(val_losses: list[tuple[int, float]], val_accuracy: float | None) -> str:
    """The summary rank 0 prints at the end: the validation curve, wrapped at 80 columns."""
    points = [f"{step + 1}: {loss:.4f}" for step, loss in val_losses] or ["none"]
    lines = ["validation loss by step:"]
    for i, point in enumerate(points):  # a line breaks between points, never inside one
        text = point + ("," if i < len(points) - 1 else "")
        if len(lines[-1]) + 1 + len(text) > 80:
            lines.append(" ")
        lines[-1] += " " + text
    if val_accuracy is not None:
        lines.append(f"validation accuracy: {val_accuracy:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
