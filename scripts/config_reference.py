"""Print the configuration reference (Markdown) generated from the config docstrings, or with
--write rewrite docs/configuration.md in place (run from anywhere; see
mcore_rl/config/reference.py)."""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mcore_rl.config.reference import DOC_PATH, render  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"rewrite {DOC_PATH}")
    if parser.parse_args().write:
        with open(os.path.join(ROOT, DOC_PATH), "w", encoding="utf-8") as handle:
            handle.write(render())
        print(f"wrote {DOC_PATH}")
    else:
        sys.stdout.write(render())


if __name__ == "__main__":
    main()
