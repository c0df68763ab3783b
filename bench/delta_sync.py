"""Benchmark: delta weight syncs against whole syncs (issue 66, rollout.delta_sync).

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python bench/delta_sync.py \
        [--setups smollm2-lr1e-6,smollm2-lr1e-5,quickstart] [--steps 20] [--out runs/bench_delta]

Each setup is one RL job run twice as a torchrun job of `mcore-rl train`, the same seeds: with
whole syncs, then with delta syncs. The table gives, per sync after the first (steps 2+), the
bytes the most-receiving rollout rank received (mean and max over the steps) next to the plan's
lower bound, the delta's share of it, the sync's seconds (the trainer's time/reshard, median),
the share over the syncs after the first step with a gradient (before it, with small GRPO
groups whose rewards tie, nothing moves: Adam's moments are still zero), and whether every
step's training figures (rewards, losses, the engine/trainer log-prob gap:
every metric but wall-clock, memory and reshard figures) are equal in the two runs.

Setups:
  smollm2-lr1e-6, smollm2-lr1e-5  SmolLM2-135M-Instruct (configs/grpo_smollm2_reasoning_gym.yaml,
      its HF folder at --smollm2) in bf16, split placement (one trainer rank, one rollout rank:
      every sync crosses the bridge), small batches (2 prompts x 2 samples, 16 new tokens) so a
      step takes about a minute on these CPUs: the share depends on the optimizer's update,
      which Adam normalises, not on the batch size.
  quickstart  the quickstart's GRPO as scripts/quickstart.sh runs it (configs/quickstart/grpo.yaml
      at PP2: tiny Llama, fp32, lr 3e-4, world 2, colocated PP2 -> rollout TP2).

`--report FILE` prints the table of a saved results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

from async_rl import _torchrun, prepare_quickstart  # noqa: E402

from mcore_rl.observability.step_metrics import MACHINE_METRIC_PREFIXES  # noqa: E402

SMOLLM2 = ["--config", "configs/grpo_smollm2_reasoning_gym.yaml", "runtime.precision=bf16",
           "placement.rollout_ranks=1", "rollout.prompts_per_step=2", "rollout.sampling.n=2",
           "rollout.sampling.max_new_tokens=16", "trainer.eval_every=0"]
COMMON = ["trainer.save_every=0", "trainer.export_hf_every=0", "trainer.console_every=10"]
NOT_TRAINING = (*MACHINE_METRIC_PREFIXES, "reshard/", "wall_time")
MODES = {"whole": [], "delta": ["rollout.delta_sync=true"]}


def setup_arguments(setup: str, args) -> list[str]:
    if setup.startswith("smollm2-lr"):
        return SMOLLM2 + [f"init.hf_path={args.smollm2}",
                          f"actor.optimizer.lr={setup.removeprefix('smollm2-lr')}"]
    if setup == "quickstart":
        folder = os.path.join(args.out, "quickstart_data")
        prepare_quickstart(folder)
        return ["--config", "configs/quickstart/grpo.yaml", "parallel.pipeline_model_parallel_size=2",
                f"init.checkpoint={folder}/sft/model",
                f"data.train_files=[{folder}/data/rl_train.jsonl]",
                f"data.val_files=[{folder}/data/rl_val.jsonl]", "trainer.eval_every=0"]
    raise SystemExit(f"unknown setup {setup!r}")


def run(setup: str, mode: str, args) -> list[dict]:
    """The job's metrics, one dict per step (a finished run in --out is read, not rerun)."""
    run_dir = os.path.join(args.out, setup, mode)
    metrics = os.path.join(run_dir, "run", "metrics.jsonl")
    if os.path.exists(metrics) and len(open(metrics).readlines()) == args.steps:
        return [json.loads(line) for line in open(metrics)]
    os.makedirs(run_dir, exist_ok=True)
    _torchrun(2, ["train", *setup_arguments(setup, args), *COMMON, *MODES[mode],
                  f"trainer.total_steps={args.steps}", f"runtime.output_dir={run_dir}/run"],
              os.path.join(run_dir, "log.txt"))
    return [json.loads(line) for line in open(metrics)]


def training_figures(step: dict) -> dict:
    return {name: "nan" if isinstance(value, float) and math.isnan(value) else value
            for name, value in step.items() if not name.startswith(NOT_TRAINING)}


def summarize(steps: dict[str, list[dict]]) -> dict:
    """Per mode: bytes and seconds of the syncs of steps 2+; equality of the training figures."""
    row = {"steps": len(steps["whole"]),
           "lower_bound": steps["whole"][0]["reshard/lower_bound_bytes"],
           "equal_steps": sum(training_figures(a) == training_figures(b)
                              for a, b in zip(steps["whole"], steps["delta"]))}
    first_update = next((index for index, step in enumerate(steps["whole"])
                         if step["actor/grad_norm"] > 0), len(steps["whole"]))
    row["first_update_step"] = first_update + 1
    for mode, history in steps.items():
        later = history[1:]
        moved = history[first_update + 1:] or [{"reshard/delta_share": math.nan}]
        received = [step["reshard/bytes_received_max"] for step in later]
        row[mode] = {"bytes_mean": statistics.mean(received), "bytes_max": max(received),
                     "share_max": max(step["reshard/delta_share"] for step in later),
                     "moved_share_mean": statistics.mean(s["reshard/delta_share"] for s in moved),
                     "first_sync_bytes": history[0]["reshard/bytes_received_max"],
                     "seconds_median": statistics.median(step["time/reshard"] for step in later),
                     "shares": [round(step["reshard/delta_share"], 4) for step in later]}
    return row


def print_table(results: dict) -> None:
    header = (f"{'setup':<16} {'mode':<6} {'lower bound MB':>14} {'sync 1 MB':>9} "
              f"{'steps 2+ MB mean':>16} {'max':>7} {'share mean':>10} {'share max':>9} "
              f"{'moved share':>11} {'s/sync':>7} {'ratio':>6} {'equal steps':>11}")
    print(header)
    print("-" * len(header))
    for setup, row in results.items():
        bound = row["lower_bound"]
        for mode in MODES:
            figures = row[mode]
            ratio = figures["seconds_median"] / row["whole"]["seconds_median"]
            print(f"{setup:<16} {mode:<6} {bound / 2 ** 20:>14.2f} "
                  f"{figures['first_sync_bytes'] / 2 ** 20:>9.2f} "
                  f"{figures['bytes_mean'] / 2 ** 20:>16.3f} {figures['bytes_max'] / 2 ** 20:>7.3f} "
                  f"{figures['bytes_mean'] / bound if bound else math.nan:>10.2%} "
                  f"{figures['share_max']:>9.2%} "
                  f"{figures['moved_share_mean']:>11.2%} "
                  f"{figures['seconds_median']:>7.3f} {ratio:>6.2f} "
                  f"{row['equal_steps']:>7}/{row['steps']}")
    for setup, row in results.items():
        print(f"{setup} delta shares, steps 2+ (first step with a gradient: "
              f"{row['first_update_step']}): {row['delta']['shares']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setups", default="smollm2-lr1e-6,smollm2-lr1e-5,quickstart")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--smollm2", default="runs/models/smollm2-135m-instruct")
    parser.add_argument("--out", default="runs/bench_delta")
    parser.add_argument("--report", help="print the table of a saved results.json")
    args = parser.parse_args()
    if args.report:
        print_table(json.load(open(args.report)))
        return
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "results.json")
    for setup in args.setups.split(","):
        row = summarize({mode: run(setup, mode, args) for mode in MODES})
        # read again just before writing: another invocation may run other setups meanwhile
        results = json.load(open(path)) if os.path.exists(path) else {}
        results[setup] = row
        with open(f"{path}.{os.getpid()}", "w") as out:
            json.dump(results, out, indent=1)
        os.replace(f"{path}.{os.getpid()}", path)
    print_table(results)


if __name__ == "__main__":
    main()
