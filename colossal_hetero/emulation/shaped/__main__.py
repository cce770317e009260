"""``python -m colossal_hetero.emulation.shaped [options] -- COMMAND ...``

Runs COMMAND as N ranks on shaped links (torchrun's variables set, as under
``colossal-hetero train``): for trying a script on a slow network, and for the tests.
"""

from __future__ import annotations

import argparse
import sys

from colossal_hetero.config import ConfigError, load_config
from colossal_hetero.config.schema import NetworkEmulationConfig
from colossal_hetero.emulation.shaped.launcher import run_shaped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colossal_hetero.emulation.shaped")
    parser.add_argument("--world", type=int, required=True, help="ranks")
    parser.add_argument("--config", default="", help="take emulation.network from this run")
    parser.add_argument("--bandwidth-gbps", type=float, default=None)
    parser.add_argument("--latency-us", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=None, help="seconds (exit 124)")
    parser.add_argument("--prefix", default=None, help="namespace prefix, chs-XXXXXX-")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    try:
        if args.config:
            net = load_config(args.config).emulation.network
        else:
            net = NetworkEmulationConfig(
                mode="shaped", bandwidth_gbps=args.bandwidth_gbps, latency_us=args.latency_us
            )
        return run_shaped(net, args.world, command, timeout_s=args.timeout, prefix=args.prefix)
    except ConfigError as error:
        print(f"colossal-hetero: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
