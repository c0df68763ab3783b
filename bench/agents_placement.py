"""Benchmark: the agents example's GRPO at colocated and split placement (issue 49, item 5).

    AGENTS_DIR=/tmp/agents bash scripts/agents_example.sh trainer.total_steps=0   # once
    OMP_NUM_THREADS=1 .venv/bin/python bench/agents_placement.py --agents-dir /tmp/agents \\
        [--steps 30] [--rounds 1]

Every variant starts GRPO from the example's SFT model with the same seed on the same 2 CPU
ranks (scripts/torchrun.sh), evaluations at the start, halfway and at the end:

    colocated      both ranks train and generate (DP2), in turn
    split k=0      rank 0 trains, rank 1 generates; synchronous (on-policy)
    split k=1      batch i + 1 generated while step i trains; episodes take the update
                   in flight (rollout.update_check_steps=8), importance_cap 2

The table gives each variant's median step time (steps 6 on), its samples (episodes) per
second and that rate over colocated's, the share of trained episodes that two versions
sampled (episode/multi_version, mean over steps) and the held-out accuracy at each evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess

VARIANTS = {
    "colocated": [],
    "split k=0": ["placement.rollout_ranks=1"],
    "split k=1": ["placement.rollout_ranks=1", "rollout.max_staleness=1",
                  "rollout.importance_cap=2.0"],
}


def run(variant: str, folder: str, agents_dir: str, steps: int) -> dict:
    """One GRPO run of `variant` into `folder`; its figures."""
    command = [
        "scripts/torchrun.sh", "train", "--config", "configs/quickstart/agents_grpo.yaml",
        f"init.checkpoint={agents_dir}/sft/model", f"runtime.output_dir={folder}",
        f"data.train_files=[{agents_dir}/data/rl_train.jsonl]",
        f"data.val_files=[{agents_dir}/data/rl_val.jsonl]", f"trainer.total_steps={steps}",
        f"trainer.eval_every={steps // 2}", "trainer.save_every=0",
        "trainer.export_hf_every=0", *VARIANTS[variant]]
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    environment = {"PYTHON": ".venv/bin/python", **os.environ, "NPROC_PER_NODE": "2",
                   "OMP_NUM_THREADS": "1"}
    with open(os.path.join(os.path.dirname(folder), f"{os.path.basename(folder)}.log"),
              "w") as log:
        subprocess.run(command, env=environment, stdout=log, stderr=subprocess.STDOUT,
                       check=True)
    rows = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    evaluations = [json.loads(line) for line in open(os.path.join(folder, "eval.jsonl"))]
    steady = [row for row in rows if row["step"] > 5]
    step_seconds = statistics.median(row["time/step"] for row in steady)
    return {"step_seconds": step_seconds,
            "samples_per_second": _episodes_per_step() / step_seconds,
            "multi_version": statistics.mean(row.get("episode/multi_version", 0.0)
                                             for row in rows),
            "accuracy": [row["eval/accuracy"] for row in evaluations]}


def _episodes_per_step() -> int:
    """prompts_per_step x sampling.n of the example's config."""
    from mcore_rl.config import load_config

    rollout = load_config("configs/quickstart/agents_grpo.yaml").rollout
    return rollout.prompts_per_step * rollout.sampling.n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents-dir", required=True,
                        help="AGENTS_DIR of a finished scripts/agents_example.sh (its SFT model "
                             "and data)")
    parser.add_argument("--out", default="runs/bench_agents_placement")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated; colocated is the baseline (its rate, 1.00)")
    args = parser.parse_args()
    results = {variant: [] for variant in args.variants.split(",")}
    for round_index in range(args.rounds):
        for variant in results:  # interleaved, so that machine noise hits every variant
            folder = os.path.join(args.out, f"{variant.replace(' ', '_')}_{round_index}")
            results[variant].append(run(variant, folder, args.agents_dir, args.steps))
    baseline = statistics.median(r["samples_per_second"] for r in results.get("colocated", [])
                                 or [{"samples_per_second": float("nan")}])
    print(f"\n{'variant':<12} {'step (s)':>9} {'samples/s':>10} {'vs coloc.':>10} "
          f"{'multi-version':>14}  held-out accuracy (steps 0, {args.steps // 2}, "
          f"{args.steps})")
    for variant, runs in results.items():
        for figures in runs:
            accuracy = ", ".join(f"{value:.3f}" for value in figures["accuracy"])
            print(f"{variant:<12} {figures['step_seconds']:>9.2f} "
                  f"{figures['samples_per_second']:>10.1f} "
                  f"{figures['samples_per_second'] / baseline:>10.2f} "
                  f"{figures['multi_version']:>14.3f}  {accuracy}")


if __name__ == "__main__":
    main()
