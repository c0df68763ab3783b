"""`python -m mcore_rl ...` is the same as `mcore-rl ...` (what the launch scripts run)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
