"""`mcore-rl` command line: one sub-command per job, each taking a YAML config and overrides.

    mcore-rl smoke --config configs/smoke.yaml parallel.tensor_model_parallel_size=2

Every rank of a torchrun/srun world runs the same command line (see scripts/torchrun.sh).
"""

from __future__ import annotations

import argparse
import sys

from .config import ConfigError, load_config
from .runtime.log import quiet_known_warnings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mcore-rl", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    smoke = commands.add_parser("smoke", help="distributed forward/backward on random tokens")
    smoke.add_argument("--config", help="YAML config file (defaults apply when omitted)")
    smoke.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    quiet_known_warnings()
    try:
        config = load_config(args.config, args.overrides)
        if args.command == "smoke":
            from .smoke import run_smoke
            run_smoke(config)
    except ConfigError as error:
        print(f"mcore-rl: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
