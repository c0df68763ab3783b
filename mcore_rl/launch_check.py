"""The check a launcher runs before it starts any rank.

    python -m mcore_rl.launch_check [--as NAME] WORLD NODES RANKS_PER_NODE COMMAND [--config FILE] [key=value ...]
        [--torchrun TORCHRUN_ARGS ...]

torchrun and srun start one process per rank, so a job the ranks themselves refuse prints its
error once per rank, followed by the launcher's own traceback. scripts/torchrun.sh and
scripts/slurm/launch.sh run this first instead: the config and overrides are loaded, the model
read from its init checkpoint and every rule of COMMAND (train, sft, smoke) checked against the
world the launcher is about to start. A broken rule is printed once, as `NAME: error: ...`, and
the exit status is 2; nothing starts. Commands that start no world pass unchecked.

With `--torchrun ARGS...` (what scripts/torchrun.sh runs), a job that passes is then launched by
torchrun's agent in this same process (`python -m torch.distributed.run ARGS...`): the check and
the agent share one interpreter and one import of torch instead of starting two (about 3 s of
every launch). The agent still starts no rank before the check has passed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .config import ConfigError, JobConfig, load_config, validate, validate_rl, validate_sft
from .config.job import validate_dataset_job
from .conversion.model_source import with_model_from_init

CHECKED_COMMANDS = ("train", "sft", "smoke")


def check_job(command: str, config_path: str | None, overrides: list[str], world: int,
              nodes: int, ranks_per_node: int) -> JobConfig:
    """The validated config of `mcore-rl COMMAND` on `world` ranks; ConfigError (or ValueError,
    FileNotFoundError) naming the rule otherwise."""
    config = with_model_from_init(load_config(config_path, overrides))
    world_error = _world_error(config, config_path, world, nodes, ranks_per_node)
    try:
        checked = _validated(command, config, world)
    except ConfigError as error:  # the launcher's view of the world first, then every rule
        raise ConfigError("\n".join(filter(None, (world_error, str(error))))) from error
    if world_error:
        raise ConfigError(world_error)
    return checked


def _world_error(config: JobConfig, config_path: str | None, world: int, nodes: int,
                 ranks_per_node: int) -> str:
    """The world the launcher starts against the model-parallel size ("" when it fits)."""
    parallel = config.parallel
    model_parallel = (parallel.tensor_model_parallel_size
                      * parallel.pipeline_model_parallel_size * parallel.context_parallel_size)
    rollout_ranks = config.placement.rollout_ranks
    trainers = world - rollout_ranks
    if model_parallel >= 1 and trainers > 0 and trainers % model_parallel == 0:
        return ""
    training = (f", less placement.rollout_ranks={rollout_ranks}: {trainers} trainer ranks,"
                if rollout_ranks else ",")
    return (f"{nodes} node(s) x {ranks_per_node} rank(s) per node = world size {world}"
            f"{training} which must be divisible by tensor_model_parallel_size "
            f"{parallel.tensor_model_parallel_size} x pipeline_model_parallel_size "
            f"{parallel.pipeline_model_parallel_size} x context_parallel_size "
            f"{parallel.context_parallel_size} = {model_parallel} (from "
            f"{config_path or 'the defaults'} and the overrides)")


def _validated(command: str, config: JobConfig, world: int) -> JobConfig:
    if command == "train":
        from .algorithms import unregistered_names
        return validate_rl(config, world, unregistered_names(config.algorithm))
    if command == "sft":
        return validate_sft(config, world)
    if command in ("rm", "dpo"):
        return validate_dataset_job(config, world, command, command.upper())
    return validate(config, world)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mcore_rl.launch_check", allow_abbrev=False)
    parser.add_argument("--as", dest="name", default="mcore-rl", help="prefix of the message")
    for name in ("world", "nodes", "ranks_per_node"):
        parser.add_argument(name, type=int)
    parser.add_argument("command")
    parser.add_argument("--config", default=None)
    parser.add_argument("overrides", nargs="*")
    return parser


TORCHRUN_FLAG = "--torchrun"
"""Everything after it is torchrun's command line, run here once the check has passed."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    torchrun = None
    if TORCHRUN_FLAG in argv:
        at = argv.index(TORCHRUN_FLAG)
        argv, torchrun = argv[:at], argv[at + 1:]
    try:
        status = _check(argv)
    except Exception:  # noqa: BLE001 - the check itself broke: nothing starts, status 2
        if torchrun is None:
            raise
        import traceback
        traceback.print_exc()
        return 2
    if status or torchrun is None:
        return status
    _say_check_seconds()
    from torch.distributed.run import main as run_torchrun

    run_torchrun(torchrun)
    return 0


def _check(argv: list[str]) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_intermixed_args(argv)
    if args.command not in CHECKED_COMMANDS:  # its flags are its own (convert --hf, plan ...)
        return 0
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        check_job(args.command, args.config, args.overrides, args.world, args.nodes,
                  args.ranks_per_node)
    except (ConfigError, ValueError, FileNotFoundError) as error:  # what `mcore-rl` reports
        print(f"{args.name}: error: {error}", file=sys.stderr)
        return 2
    return 0


def _say_check_seconds() -> None:
    """Export the seconds from this process's start to the end of the check, for the ranks'
    start-up breakdown (observability.startup)."""
    from .observability.startup import LAUNCH_CHECK_ENV, process_started_at

    started = process_started_at()
    if started is not None:
        os.environ[LAUNCH_CHECK_ENV] = f"{max(0.0, time.time() - started):.3f}"


if __name__ == "__main__":
    sys.exit(main())
