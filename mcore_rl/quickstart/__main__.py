"""`python -m mcore_rl.quickstart prepare|report|preference-report|prepare-agents|
prepare-wide-teacher|distill-report DIR`: the quickstart's first and last steps
(scripts/quickstart.sh runs the conversion, SFT and GRPO between them;
scripts/preference_pipeline.sh SFT, a reward model, PPO and DPO; scripts/agents_example.sh the
tool-use example's SFT and GRPO; scripts/distill_example.sh the distillation example)."""

from __future__ import annotations

import argparse
import sys

from . import agents_example, distill_example
from .files import prepare, report
from .preference_report import preference_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcore_rl.quickstart",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("prepare", "report", "preference-report",
                                         "prepare-agents", "prepare-wide-teacher",
                                         "distill-report"))
    parser.add_argument("directory", help="the quickstart's directory (runs/quickstart)")
    args = parser.parse_args(argv)
    if args.step == "prepare":
        prepare(args.directory)
    elif args.step == "prepare-agents":
        agents_example.prepare(args.directory)
    elif args.step == "prepare-wide-teacher":
        distill_example.prepare_wide_teacher(args.directory)
    elif args.step == "distill-report":
        print(distill_example.distill_report(args.directory))
    elif args.step == "report":
        print(report(args.directory))
    else:
        print(preference_report(args.directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
