"""Benchmark: colocated vs split placement, synchronous vs asynchronous (issue 18).

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python bench/async_rl.py \
        [--worlds 2,4] [--regimes quickstart,long] [--out runs/bench_async]

Five ways to run the same GRPO job, each a torchrun job of `mcore-rl train` on --worlds ranks:

    colocated-sync    every rank generates (vLLM), then every rank trains
    colocated-ahead   the same ranks, rollout.async_rollout: batch i+1 is generated with the
                      weights of step i, before step i trains (one step off-policy, no overlap)
    split-k0          placement.rollout_ranks = world / 2: half the ranks only generate, half only
                      train, rollout.max_staleness = 0 (on-policy: each waits for the other)
    split-k1, -k2     the same with max_staleness 1 and 2: generation of the next batches
                      overlaps training on the current one

Off-policy variants train with truncated importance sampling (rollout.importance_cap=2).
rollout_tp is 1 everywhere (a split world of 2 has one rollout rank), so colocated runs one vLLM
instance per rank and split runs one per rollout rank.

Regimes:
  quickstart  the quickstart's GRPO (SFT checkpoint of the tiny Llama, 2-token answers,
              configs/quickstart/grpo.yaml) for --steps steps with held-out accuracy every
              --eval-every steps. Reported: time to --threshold held-out accuracy (seconds from
              launch, start-up included, and the step it was reached at).
  long        generation-bound: the toy task's random-init model samples up to 48 new tokens
              with no trained stop, so response lengths are long and uneven (a group waits for
              its longest); lr 0 keeps every variant's policy, and so its work, the same.

Every run reports samples/s over its steps after the first (start-up and the first step's
warm-up excluded; evaluations included, every variant pays them) and, from the run's timeline
(timeline.jsonl, timeline_rollout.jsonl), the idle fractions over the same steps:

    trainer idle  share of the training ranks' time outside training phases (waiting for a
                  batch, generating or scoring when colocated, resharding, gaps)
    rollout idle  share of the engine ranks' time outside generate / reward

The runs go one at a time and print one table with ratios to colocated-sync of the same world
and regime (samples/s) in the same invocation. The quickstart's steps take a fraction of a
second, so its figures move by tens of percent from run to run on a shared machine: `--rounds N`
repeats every run, alternating the variants' order, and the table gives medians (and each
round's samples/s). `--report FILE` prints the table of a saved results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
PYTHON = os.path.join(REPO, ".venv", "bin", "python")

OFF_POLICY = ["rollout.importance_cap=2.0"]
VARIANTS = {
    "colocated-sync": lambda world: [],
    "colocated-ahead": lambda world: ["rollout.async_rollout=true", *OFF_POLICY],
    "split-k0": lambda world: [f"placement.rollout_ranks={world // 2}"],
    "split-k1": lambda world: [f"placement.rollout_ranks={world // 2}",
                               "rollout.max_staleness=1", *OFF_POLICY],
    "split-k2": lambda world: [f"placement.rollout_ranks={world // 2}",
                               "rollout.max_staleness=2", *OFF_POLICY],
}
"""Variant name -> its overrides for a world size."""

ROLLOUT_BUSY = {"generate", "reward"}
NOT_TRAINING = {"generate", "generate_baseline", "reward", "switch", "reshard", "wait"}
"""Timeline phases: what counts as the engine working, and what is not training."""

COMMON = ["rollout.rollout_tp=1", "trainer.save_every=0", "trainer.export_hf_every=0",
          "trainer.console_every=10"]


def regime_overrides(regime: str, args, quickstart_dir: str) -> list[str]:
    if regime == "quickstart":
        return ["--config", "configs/quickstart/grpo.yaml",
                f"init.checkpoint={quickstart_dir}/sft/model",
                f"data.train_files=[{quickstart_dir}/data/rl_train.jsonl]",
                f"data.val_files=[{quickstart_dir}/data/rl_val.jsonl]",
                f"trainer.total_steps={args.steps}", f"trainer.eval_every={args.eval_every}"]
    return ["--config", "configs/grpo_toy.yaml", "rollout.sampling.max_new_tokens=48",
            "actor.optimizer.lr=0.0", f"trainer.total_steps={args.long_steps}",
            "trainer.eval_every=0"]


def prepare_quickstart(folder: str) -> None:
    """The quickstart's data, converted model and SFT checkpoint (once; reused when present)."""
    if os.path.isdir(os.path.join(folder, "sft", "model")):
        return
    subprocess.run([PYTHON, "-m", "mcore_rl.quickstart", "prepare", folder], check=True,
                   cwd=REPO)
    if not os.path.isdir(os.path.join(folder, "mcore_init")):
        subprocess.run([PYTHON, "-m", "mcore_rl", "convert", "hf-to-mcore", "--hf",
                        f"{folder}/hf_init", "--out", f"{folder}/mcore_init"], check=True,
                       cwd=REPO)
    _torchrun(2, ["sft", "--config", "configs/quickstart/sft.yaml",
                  "parallel.tensor_model_parallel_size=2",
                  f"init.checkpoint={folder}/mcore_init", f"runtime.output_dir={folder}/sft",
                  f"sft.train_files=[{folder}/data/sft_train.jsonl]",
                  f"sft.val_files=[{folder}/data/sft_val.jsonl]"], os.path.join(folder, "sft.log"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(world: int, arguments: list[str], log_path: str) -> float:
    """Run `mcore-rl ARGUMENTS` on `world` ranks; returns the launch time (unix seconds)."""
    launched = time.time()
    with open(log_path, "w") as log:
        done = subprocess.run(
            [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
             "--master_port", str(_free_port()), "--log-dir", "/dev/null", "-m", "mcore_rl",
             *arguments],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"mcore-rl {' '.join(arguments)} failed ({done.returncode}): see "
                           f"{log_path}")
    return launched


def measure(regime: str, variant: str, world: int, args, quickstart_dir: str,
            round_index: int) -> dict:
    run_dir = os.path.join(args.out, regime, f"w{world}-{variant}-r{round_index}")
    os.makedirs(run_dir, exist_ok=True)
    arguments = ["train", *regime_overrides(regime, args, quickstart_dir), *COMMON,
                 *VARIANTS[variant](world), f"runtime.output_dir={run_dir}/run"]
    launched = _torchrun(world, arguments, os.path.join(run_dir, "log.txt"))
    first_rollout_rank = world - world // 2 if variant.startswith("split") else None
    return summarize(os.path.join(run_dir, "run"), launched, args.threshold, first_rollout_rank)


def summarize(run_dir: str, launched: float, threshold: float,
              first_rollout_rank: int | None) -> dict:
    """One run's figures (see the module docstring); first_rollout_rank: None when
    colocated."""
    import yaml

    from mcore_rl.observability.timeline import read_timeline

    steps = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    config = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
    samples_per_step = config["rollout"]["prompts_per_step"] * config["rollout"]["sampling"]["n"]
    seconds = steps[-1]["wall_time"] - steps[0]["wall_time"]
    evals = _evaluations(run_dir)
    reached = next((row for row in evals if row["eval/accuracy"] >= threshold), None)
    return {"steps": len(steps), "seconds": seconds,
            "samples_per_second": samples_per_step * (len(steps) - 1) / seconds,
            "eval_accuracy": [round(row["eval/accuracy"], 3) for row in evals],
            "seconds_to_threshold": reached["wall_time"] - launched if reached else None,
            "step_at_threshold": reached["step"] if reached else None,
            **idle_fractions(read_timeline(run_dir, len(steps) - 1), first_rollout_rank)}


def _evaluations(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "eval.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path)]


def idle_fractions(intervals: list[dict], first_rollout_rank: int | None) -> dict:
    """Trainer-idle and rollout-idle fractions over the recorded span (module docstring)."""
    if not intervals:
        return {"trainer_idle": None, "rollout_idle": None}
    span = max(row["end"] for row in intervals) - min(row["start"] for row in intervals)
    ranks = {row["rank"] for row in intervals}
    if first_rollout_rank is None:
        trainer_ranks = engine_ranks = ranks
    else:
        trainer_ranks = {rank for rank in ranks if rank < first_rollout_rank}
        engine_ranks = ranks - trainer_ranks

    def busy(ranks: set, counted) -> float:
        return sum(row["end"] - row["start"] for row in intervals
                   if row["rank"] in ranks and counted(row["phase"])) / len(ranks) / span

    return {"trainer_idle": 1 - busy(trainer_ranks, lambda phase: phase not in NOT_TRAINING),
            "rollout_idle": 1 - busy(engine_ranks, lambda phase: phase in ROLLOUT_BUSY)}


def print_table(results: list[dict]) -> None:
    """One row per regime, world and variant: medians over the rounds (samples/s per round
    too), the ratio of medians to colocated-sync of the same regime and world."""
    rows: dict[tuple, list[dict]] = {}
    for result in results:
        rows.setdefault((result["regime"], result["world"], result["variant"]), []).append(result)
    median = {key: {name: _median([run[name] for run in runs]) for name in
                    ("samples_per_second", "seconds_to_threshold", "step_at_threshold",
                     "trainer_idle", "rollout_idle")} for key, runs in rows.items()}
    header = (f"{'regime':<11}{'world':>6}  {'variant':<16}{'samples/s':>10}{'vs sync':>8}"
              f"{'to acc (s)':>11}{'at step':>8}{'trainer idle':>13}{'rollout idle':>13}"
              f"  samples/s per round; held-out accuracy (last round)")
    print(header)
    print("-" * len(header))
    for (regime, world, variant), runs in rows.items():
        figures = median[(regime, world, variant)]
        base = median.get((regime, world, "colocated-sync"), {}).get("samples_per_second")
        ratio = figures["samples_per_second"] / base if base else None
        per_round = ", ".join(f"{run['samples_per_second']:.0f}" for run in runs)
        print(f"{regime:<11}{world:>6}  {variant:<16}{figures['samples_per_second']:>10.1f}"
              f"{_cell(ratio, '.2f'):>8}{_cell(figures['seconds_to_threshold'], '.0f'):>11}"
              f"{_cell(figures['step_at_threshold'], '.0f'):>8}"
              f"{_cell(figures['trainer_idle'], '.0%'):>13}"
              f"{_cell(figures['rollout_idle'], '.0%'):>13}"
              f"  {per_round}; {runs[-1]['eval_accuracy']}")


def _median(values: list):
    present = sorted(value for value in values if value is not None)
    return statistics.median(present) if present else None


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,4", help="world sizes (even)")
    parser.add_argument("--regimes", default="quickstart,long")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=60, help="quickstart regime steps")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=0.8,
                        help="held-out accuracy the quickstart regime is timed to")
    parser.add_argument("--long-steps", type=int, default=8, help="long regime steps")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat every run, alternating the variants' order")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench_async"))
    parser.add_argument("--report", help="print the table of a saved results.json and exit")
    args = parser.parse_args()
    if args.report:
        print_table(json.load(open(args.report)))
        return
    args.out = os.path.abspath(args.out)
    quickstart_dir = os.path.join(args.out, "quickstart_inputs")
    regimes = args.regimes.split(",")
    if "quickstart" in regimes:
        prepare_quickstart(quickstart_dir)
    results = []
    for round_index in range(args.rounds):
        variants = args.variants.split(",")[::-1 if round_index % 2 else 1]
        for regime in regimes:
            for world in (int(w) for w in args.worlds.split(",")):
                for variant in variants:
                    figures = measure(regime, variant, world, args, quickstart_dir, round_index)
                    results.append({"regime": regime, "world": world, "variant": variant,
                                    "round": round_index, **figures})
                    print(f"round {round_index} {regime} world {world} {variant}: "
                          f"{figures['samples_per_second']:.2f} samples/s", flush=True)
                with open(os.path.join(args.out, "results.json"), "w") as handle:
                    json.dump(results, handle, indent=1)
    print_table(results)


if __name__ == "__main__":
    main()
