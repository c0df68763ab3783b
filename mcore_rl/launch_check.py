"""The check a launcher runs before it starts any rank.

    python -m mcore_rl.launch_check [--as NAME] WORLD NODES RANKS_PER_NODE COMMAND [--config FILE] [key=value ...]

torchrun and srun start one process per rank, so a job the ranks themselves refuse prints its
error once per rank, followed by the launcher's own traceback. scripts/torchrun.sh and
scripts/slurm/launch.sh run this first instead: the config and overrides are loaded, the model
read from its init checkpoint and every rule of COMMAND (train, sft, smoke) checked against the
world the launcher is about to start. A broken rule is printed once, as `NAME: error: ...`, and
the exit status is 2; nothing starts. Commands that start no world pass unchecked.
"""

from __future__ import annotations

import argparse
import sys

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


def main(argv: list[str] | None = None) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
