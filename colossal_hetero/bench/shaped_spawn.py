"""Run a bench worker on N local ranks, on shaped links or under the network model.

The one helper every benchmark uses to put its ranks on the network its config asks for:

    from colossal_hetero.bench.shaped_spawn import run_bench_ranks

    results = run_bench_ranks(my_worker, world, network=cfg.emulation.network, case=case)

- ``network.mode == "shaped"``: the shaped launcher (``emulation.shaped.launcher.run_shaped``)
  builds one network namespace per rank with tc-shaped links, as ``network`` says (rates,
  per-pair links, step-scheduled preemptions, tenant bursts), and starts each rank as
  ``python -m colossal_hetero.bench.shaped_spawn`` inside its namespace (torchrun's variables
  set, gloo over the shaped interface). Each rank calls ``my_worker`` and the namespaces are
  removed afterwards, also when a rank fails or the timeout passes.
- otherwise (``network`` None or ``mode: model``): ``bench.spawn.spawn_ranks`` (mp.spawn on
  loopback); the worker installs the network model itself, e.g. with ``build_interceptor``.

Contract of the worker, the same in both modes: a module-level function (importable by
``module:qualname``; not defined in ``__main__``) called as
``fn(rank=, world_size=, device=, **kwargs)`` after ``init_process_group``; its return value
must be JSON-serialisable; ``kwargs`` must be picklable. Shaped ranks are CPU/gloo ranks (NCCL
traffic would bypass the shaped links), so ``device`` is the CPU there. A worker that builds its
own interceptor should give it the ``network`` with ``mode: shaped`` on shaped links (the
interceptor then models no network time: the links are real); ``on_shaped_links()`` tells a
rank which it is on. Step-scheduled preemptions (``kind: rate`` and tenants) act at the steps
the ranks report: a worker calls ``report_bench_step(rank, step)`` as each step begins (a no-op
off shaped links; the trainer does the same for ``colossal-hetero train``).

Raises ConfigError (one line naming ``emulation.network.mode``) where shaped mode cannot run
(no root, no ``ip``/``tc``), before anything is created.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from colossal_hetero.config.schema import NetworkEmulationConfig
from colossal_hetero.emulation.shaped.controller import STEP_DIR_ENV, report_step
from colossal_hetero.emulation.shaped.topology import SHAPED_ENV
from colossal_hetero.utils.device import HOST_BACKEND, host_device
from colossal_hetero.utils.teardown import close_process_group

SHAPED_BENCH_TIMEOUT_S = 1800.0
"""Default bound on one shaped launch (exit 124 and full cleanup after it)."""


def on_shaped_links() -> bool:
    """Whether this process is a rank of a shaped run (the launcher sets ``SHAPED_ENV``)."""
    return bool(os.environ.get(SHAPED_ENV))


def report_bench_step(rank: int, step: int) -> None:
    """Tell the shaped launcher's preemption controller that ``rank`` starts ``step`` (tens of
    microseconds); does nothing outside a shaped run."""
    run_dir = os.environ.get(STEP_DIR_ENV)
    if run_dir:
        report_step(run_dir, rank, step)


def wants_shaped(network: NetworkEmulationConfig | None) -> bool:
    """Whether ``network`` asks for real shaped links."""
    return network is not None and network.mode == "shaped"


def run_bench_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    network: NetworkEmulationConfig | None = None,
    timeout_s: float = SHAPED_BENCH_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """``[fn(rank=r, world_size=, device=, **kwargs) for r in ranks]``, one process per rank:
    on shaped links when ``network.mode`` is ``shaped``, else spawned on loopback.

    Raises RuntimeError when a shaped rank fails (its exit code; the launcher prints the
    failing rank's log tail) or the run leaves a namespace behind.
    """
    if not wants_shaped(network):
        from colossal_hetero.bench.spawn import spawn_ranks

        return spawn_ranks(fn, world_size, **kwargs)
    assert network is not None
    results, leftovers = run_shaped_ranks(fn, world_size, network, timeout_s=timeout_s, **kwargs)
    if leftovers:
        raise RuntimeError(f"shaped bench run left {leftovers} namespaces behind")
    return results


def run_shaped_ranks(
    fn: Callable[..., Any],
    world_size: int,
    network: NetworkEmulationConfig,
    *,
    timeout_s: float = SHAPED_BENCH_TIMEOUT_S,
    prefix: str | None = None,
    **kwargs: Any,
) -> tuple[list[Any], int]:
    """Shaped mode of ``run_bench_ranks``: (per-rank results, namespaces of the run left
    afterwards). ``prefix`` names the run's namespaces (a fresh ``chs-XXXXXX-`` by default)."""
    from colossal_hetero.emulation.shaped.launcher import run_shaped
    from colossal_hetero.emulation.shaped.netns import list_namespaces
    from colossal_hetero.emulation.shaped.topology import new_prefix

    target = _qualified(fn)
    prefix = prefix or new_prefix()
    with tempfile.TemporaryDirectory(prefix="chs-bench-") as folder:
        Path(folder, "kwargs.pkl").write_bytes(pickle.dumps(kwargs))
        argv = [sys.executable, "-m", "colossal_hetero.bench.shaped_spawn"]
        argv += ["--fn", target, "--dir", folder]
        code = run_shaped(network, world_size, argv, prefix=prefix, timeout_s=timeout_s)
        leftovers = len(list_namespaces(prefix))
        if code != 0:
            raise RuntimeError(f"shaped bench run of {target} exited with {code}")
        results = [
            json.loads(Path(folder, f"result_{r}.json").read_text()) for r in range(world_size)
        ]
    return results, leftovers


def _qualified(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a function a fresh interpreter can import."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise ValueError(
            f"run_bench_ranks: {fn!r} must be a module-level function of an importable module "
            "(shaped ranks import it by name)"
        )
    return f"{module}:{name}"


def _resolve(target: str) -> Callable[..., Any]:
    module, _, name = target.partition(":")
    found: Any = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    """One shaped rank: run ``--fn`` with the kwargs in ``--dir`` and write its result there."""
    parser = argparse.ArgumentParser(prog="python -m colossal_hetero.bench.shaped_spawn")
    parser.add_argument("--fn", required=True, help="module:qualname of the worker")
    parser.add_argument("--dir", required=True, help="holds kwargs.pkl; gets result_<rank>.json")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from colossal_hetero.utils.quiet import quiet_optional_kernel_warnings

    quiet_optional_kernel_warnings()
    torch.set_num_threads(1)
    fn = _resolve(args.fn)
    kwargs = pickle.loads(Path(args.dir, "kwargs.pkl").read_bytes())  # written by our launcher
    dist.init_process_group(HOST_BACKEND)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result = fn(rank=rank, world_size=world, device=host_device(), **kwargs)
        Path(args.dir, f"result_{rank}.json").write_text(json.dumps(result))
    finally:
        close_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
