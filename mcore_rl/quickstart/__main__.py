"""`python -m mcore_rl.quickstart prepare|report|preference-report|prepare-agents|
prepare-tools|prepare-wide-teacher|distill-report DIR`: the quickstart's first and last steps
(scripts/quickstart.sh runs the conversion, SFT and GRPO between them;
scripts/preference_pipeline.sh SFT, a reward model, PPO and DPO; scripts/agents_example.sh the
tool-use example's SFT and GRPO; scripts/smollm2_tools_recipe.sh the calculator recipe's;
scripts/distill_example.sh the distillation example)."""

from __future__ import annotations

import argparse
import sys

from mcore_rl.config.load import load_config

from . import agents_example, distill_example, tools_recipe
from .files import prepare, report
from .preference_report import preference_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcore_rl.quickstart",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("prepare", "report", "preference-report",
                                         "prepare-agents", "prepare-tools",
                                         "prepare-wide-teacher",
                                         "distill-report"))
    parser.add_argument("directory", help="the quickstart's directory (runs/quickstart)")
    parser.add_argument("--config", help="prepare-tools: the GRPO config owning the task")
    parser.add_argument("--demonstrations", type=int,
                        help="prepare-tools: demonstrated episodes to write")
    args = parser.parse_args(argv)
    if args.step == "prepare":
        prepare(args.directory)
    elif args.step == "prepare-agents":
        agents_example.prepare(args.directory)
    elif args.step == "prepare-tools":
        if not args.config or not args.demonstrations:
            parser.error("prepare-tools needs --config (the recipe's GRPO config) and "
                         "--demonstrations N")
        tools_recipe.prepare(args.directory, load_config(args.config), args.demonstrations)
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
