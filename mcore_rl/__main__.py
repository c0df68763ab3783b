"""`python -m mcore_rl ...` is the same as `mcore-rl ...` (what the launch scripts run).

A rank started by torchrun arms its launcher-death signal here, before the seconds of imports the
command line needs: a launcher killed while its ranks import must not leave them running.
"""

import sys

from .runtime.process_guard import exit_with_launcher


def main(argv: list[str] | None = None) -> int:
    exit_with_launcher()
    from .cli import main as run_command

    return run_command(argv)


if __name__ == "__main__":
    sys.exit(main())
