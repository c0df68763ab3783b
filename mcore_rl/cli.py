"""`mcore-rl` command line: one sub-command per job.

    mcore-rl train --config configs/grpo_toy.yaml trainer.total_steps=50
    mcore-rl sft --config configs/quickstart/sft.yaml sft.epochs=3
    mcore-rl rm --config configs/quickstart/rm.yaml rm.epochs=2
    mcore-rl dpo --config configs/quickstart/dpo.yaml dpo.beta=0.2
    mcore-rl smoke --config configs/smoke.yaml parallel.tensor_model_parallel_size=2
    mcore-rl convert hf-to-mcore --hf PATH --out DIR --tp N --pp M [--ep E] [--etp T]
    mcore-rl convert mcore-to-hf --ckpt DIR --out PATH
    mcore-rl plan --model configs/models/llama3-70b.yaml --train-tp 8 --train-pp 4 \
        --rollout-tp 8 --gpus 64,256,1024
    mcore-rl plan --model configs/models/qwen3-30b-a3b.yaml --train-tp 4 --train-ep 8 \
        --rollout-tp 8 --gpus 32
    mcore-rl compare runs/a runs/b --output compare.png
    mcore-rl plot runs/a
    mcore-rl serve runs/quickstart/grpo/hf/step_60 --port 8000 [any vLLM serve flag]

Every rank of a torchrun/srun world runs the same command line (see scripts/torchrun.sh);
conversions also run as a single process.
"""

from __future__ import annotations

import argparse
import sys
import time

from .config import ConfigError, load_config
from .resharding.dry_run import Links
from .models.transformer_config import DTYPES
from .resharding.layouts import ENGINES
from .runtime.launch_env import read_launch_env
from .runtime.log import quiet_known_warnings
from .runtime.process_guard import guard_this_rank


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mcore-rl", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    smoke = commands.add_parser("smoke", help="distributed forward/backward on random tokens")
    smoke.add_argument("--config", help="YAML config file (defaults apply when omitted)")
    smoke.add_argument("overrides", nargs="*", help="dotted key=value overrides")

    train = commands.add_parser("train", help="RL training (PPO, GRPO and relatives)")
    train.add_argument("--config", help="YAML config file (defaults apply when omitted)")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides")

    sft = commands.add_parser("sft", help="supervised fine-tuning on demonstrations")
    sft.add_argument("--config", help="YAML config file (defaults apply when omitted)")
    sft.add_argument("overrides", nargs="*", help="dotted key=value overrides")

    for name, what in (("rm", "Bradley-Terry reward model on preference pairs"),
                       ("dpo", "direct preference optimisation (DPO, IPO) on preference pairs")):
        preference = commands.add_parser(name, help=what)
        preference.add_argument("--config", help="YAML config file (defaults apply when omitted)")
        preference.add_argument("overrides", nargs="*", help="dotted key=value overrides")

    convert = commands.add_parser("convert", help="HF <-> Megatron checkpoint conversion")
    directions = convert.add_subparsers(dest="direction", required=True)
    to_mcore = directions.add_parser("hf-to-mcore", help="HF folder -> mcore_rl checkpoint")
    to_mcore.add_argument("--hf", required=True, help="HF model folder (safetensors)")
    to_mcore.add_argument("--out", required=True, help="checkpoint directory to create")
    to_mcore.add_argument("--tp", type=int, default=1, help="target tensor-parallel size")
    to_mcore.add_argument("--pp", type=int, default=1, help="target pipeline-parallel size")
    to_mcore.add_argument("--ep", type=int, default=1,
                          help="target expert-parallel size (MoE): with tp x pp x ep processes, "
                          "each reads only its experts")
    to_mcore.add_argument("--etp", type=int, default=None,
                          help="target expert tensor-parallel size (MoE; default: --tp): each "
                          "process reads only its slice of its experts")
    to_hf = directions.add_parser("mcore-to-hf", help="mcore_rl checkpoint -> HF folder")
    to_hf.add_argument("--ckpt", required=True, help="mcore_rl checkpoint directory")
    to_hf.add_argument("--out", required=True, help="HF folder to create")
    to_hf.add_argument("--architecture", help="HF architecture (default: the source's)")
    to_hf.add_argument("--max-file-gb", type=float, default=2.0, help="safetensors file size")

    plan = commands.add_parser("plan", help="dry-run a weight sync: bytes, memory, time per rank")
    plan.add_argument("--model", required=True, help="YAML with a model section "
                      "(configs/models/*.yaml)")
    plan.add_argument("--train-tp", type=int, required=True, help="training tensor-parallel size")
    plan.add_argument("--train-pp", type=int, default=1, help="training pipeline-parallel size")
    plan.add_argument("--train-ep", type=int, default=1,
                      help="training expert-parallel size (MoE models; divides the DP size)")
    plan.add_argument("--train-etp", type=int, default=None,
                      help="training expert tensor-parallel size (MoE models; default: "
                      "--train-tp)")
    plan.add_argument("--rollout-tp", type=int, required=True, help="rollout tensor-parallel size")
    plan.add_argument("--rollout-ep", action="store_true",
                      help="vLLM's expert parallelism: each rollout rank serves its block of the "
                      "experts whole (rollout.expert_parallel)")
    plan.add_argument("--gpus", required=True,
                      help="world size, or comma-separated world sizes for a table")
    plan.add_argument("--engine", default="vllm", choices=ENGINES, help="rollout layout")
    plan.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="weight dtype")
    plan.add_argument("--gpus-per-node", type=int, default=Links.gpus_per_node)
    plan.add_argument("--intra-node-gbps", type=float, default=Links.intra_node_gbps)
    plan.add_argument("--inter-node-gbps", type=float, default=Links.inter_node_gbps)
    plan.add_argument("--bucket-mb", type=float, default=512, help="resharder bucket size")
    plan.add_argument("--delta-share", type=float, default=None,
                      help="share of the lower bound a delta sync carries (rollout.delta_sync; "
                      "measured by bench/delta_sync.py): adds its bytes, time and copies")

    compare = commands.add_parser("compare", help="A/B table and plot of run directories")
    compare.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="runtime.output_dir")
    compare.add_argument("--output", default="compare.png", help="comparison plot (PNG)")
    plot = commands.add_parser("plot", help="reward, accuracy and KL plots into RUN_DIR/plots")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="runtime.output_dir")

    serve = commands.add_parser(
        "serve", help="OpenAI-compatible server (vLLM) plus POST /generate",
        description="Flags not listed here go to vLLM's server unchanged: --host (127.0.0.1 "
                    "here, not vLLM's all interfaces), --port (8000), --api-key, "
                    "--tensor-parallel-size, --max-model-len, --dtype ...")
    serve.add_argument("model", metavar="MODEL",
                       help="HF folder (RUN_DIR/hf/step_N) or mcore_rl weights checkpoint")
    serve.add_argument("--max-body-mb", type=float, default=8.0,
                       help="larger request bodies are refused with 413")
    return parser


def _plan_errors(args, model, gpus: int) -> list[str]:
    """What the plan's layout checks cannot say in the flags' own terms: a world that is not
    whole training replicas, and expert parallelism on a model without experts."""
    replica = args.train_tp * args.train_pp
    errors = []
    if gpus % replica:
        errors.append(f"--gpus {gpus} is not a multiple of --train-tp x --train-pp = {replica}")
    if args.train_ep < 1:
        errors.append(f"--train-ep {args.train_ep} must be at least 1")
    elif args.train_ep > 1 and not model.moe.enabled:
        errors.append(f"--train-ep {args.train_ep} needs a Mixture-of-Experts model "
                      "(model.moe.num_experts > 0); this one is dense")
    return errors


def _plan(args) -> None:
    from .resharding.dry_run import production_estimate, table_header, table_row

    model = load_config(args.model).model
    links = Links(args.gpus_per_node, args.intra_node_gbps, args.inter_node_gbps)
    if args.delta_share is not None and not 0 < args.delta_share <= 1:
        raise ValueError(f"--delta-share={args.delta_share} must be in (0, 1]")
    print("\n".join(table_header(args.delta_share)))
    for gpus in (int(value) for value in args.gpus.split(",")):
        errors = _plan_errors(args, model, gpus)
        if errors:
            raise ValueError("; ".join(errors))
        # The layouts' own rules (EP dividing the DP size and the experts, heads, vocabulary)
        # raise PlanError, a ValueError: main prints it.
        dp = gpus // (args.train_tp * args.train_pp)
        production = production_estimate(model, args.train_tp, args.train_pp, dp, args.engine,
                                         args.rollout_tp, DTYPES[args.dtype], links,
                                         int(args.bucket_mb * 1024 ** 2), args.train_ep,
                                         args.train_etp, args.rollout_ep)
        print(table_row(production, args.delta_share), flush=True)


def _convert(args) -> None:
    from .conversion.hf_to_mcore import convert_hf_to_mcore
    from .conversion.mcore_to_hf import convert_mcore_to_hf
    from .runtime import peak_resident_mb, print0, shutdown, start_process_group

    start_process_group()
    start = time.perf_counter()
    if args.direction == "hf-to-mcore":
        convert_hf_to_mcore(args.hf, args.out, args.tp, args.pp, args.ep, args.etp)
    else:
        convert_mcore_to_hf(args.ckpt, args.out, args.architecture,
                            int(args.max_file_gb * 1024 ** 3))
    seconds = time.perf_counter() - start
    print0(f"convert {args.direction}: wrote {args.out} in {seconds:.1f} s "
           f"(peak resident memory of the largest rank: {peak_resident_mb():.0f} MB)")
    shutdown()


def main(argv: list[str] | None = None) -> int:
    from .observability.startup import STARTUP

    STARTUP.lap("imports")  # the interpreter and the command line's imports (torch among them)
    parser = _parser()
    args, passthrough = parser.parse_known_args(argv)
    if passthrough and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(passthrough)}")
    guard_this_rank()
    quiet_known_warnings()
    try:
        if args.command == "convert":
            _convert(args)
        elif args.command == "plan":
            _plan(args)
        elif args.command == "compare":
            from .observability import compare_command
            compare_command(args.run_dirs, args.output)
        elif args.command == "plot":
            from .observability import plot_command
            plot_command(args.run_dir)
        elif args.command == "serve":
            from .serve import serve
            serve(args.model, passthrough, int(args.max_body_mb * 1024 ** 2))
        elif args.command == "smoke":
            from .smoke import run_smoke
            run_smoke(load_config(args.config, args.overrides))
        elif args.command == "sft":
            from .sft import run_sft
            run_sft(load_config(args.config, args.overrides))
        elif args.command in ("rm", "dpo"):
            from .preference import DpoTrainer, RewardModelTrainer
            job = RewardModelTrainer if args.command == "rm" else DpoTrainer
            job(load_config(args.config, args.overrides)).fit()
        elif args.command == "train":
            from .rl import run_training
            return run_training(load_config(args.config, args.overrides))
    except (ConfigError, ValueError, FileNotFoundError, FileExistsError) as error:
        # A config error, or one all ranks agreed on (runtime.agreement), is the same on every
        # rank: rank 0 says it. Any other error may be this rank's alone.
        said_by_rank0 = isinstance(error, ConfigError) or getattr(
            error, "raised_on_every_rank", False)
        if read_launch_env().rank == 0 or not said_by_rank0:
            print(f"mcore-rl: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
