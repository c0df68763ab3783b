"""Benchmark: CPU training steps with freed memory kept in the process vs glibc's defaults.

    OMP_NUM_THREADS=1 python bench/cpu_allocator.py [--rounds 2] [--demonstrations 24]

runtime/cpu_compat.py sets glibc's malloc to keep freed blocks (up to 32 MiB) in the heap and
not to trim it while a CPU run lives: by default a freed activation or logits block is returned
to the system, and the next micro-batch faults in freshly zeroed pages for it. Each round runs
the same `mcore-rl sft` job twice, the two settings alternating (MCORE_RL_CPU_MALLOC=system for
glibc's defaults): SmolLM2-135M-Instruct (fp32, one rank) on the calculator recipe's
demonstrations (scripts/smollm2_tools_recipe.sh), 16 rows a step in micro-batches of 8.
Reported: the median step seconds after the first (which builds the optimizer state), the
job's system CPU seconds, and the ratios; the losses must be equal (the same arithmetic).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(REPO, "runs", "models", "smollm2-135m-instruct")
STEP_LINE = re.compile(r"^step (\d+): sft/loss ([0-9.]+)  time/step ([0-9.]+)", re.MULTILINE)
SETTINGS = ("glibc defaults", "kept (mcore_rl)")


def prepare(work: str, demonstrations: int) -> str:
    """The model folder (made from the GGUF when absent) and the demonstrations file."""
    if not os.path.isdir(MODEL):
        from mcore_rl.conversion.gguf_to_hf import gguf_to_hf, smollm2_gguf_path
        gguf_to_hf(smollm2_gguf_path(), MODEL)
    from mcore_rl.config import load_config
    from mcore_rl.quickstart import tools_recipe

    config = load_config(os.path.join(REPO, "configs", "grpo_smollm2_tools.yaml"))
    tools_recipe.prepare(work, config, demonstrations)
    return os.path.join(work, "demos_train.jsonl")


def run_sft(setting: str, demonstrations: str, output: str) -> dict:
    """One SFT job: its step seconds and losses, and the system CPU seconds of its processes."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", NPROC_PER_NODE="1",
                       PYTHON=sys.executable)
    if setting == SETTINGS[0]:
        environment["MCORE_RL_CPU_MALLOC"] = "system"
    command = [os.path.join(REPO, "scripts", "torchrun.sh"), "sft", f"init.hf_path={MODEL}",
               f"runtime.output_dir={output}", f"sft.train_files=[{demonstrations}]",
               "sft.max_length=160", "sft.epochs=1", "sft.batch_size=16",
               "sft.micro_batch_size=8", "runtime.precision=fp32", "trainer.console_every=1"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True)
    system_seconds = resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime - before
    if result.returncode != 0:
        raise SystemExit(f"sft ({setting}) failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    steps = STEP_LINE.findall(result.stdout)
    return {"step_seconds": statistics.median(float(seconds) for _, _, seconds in steps[1:]),
            "losses": [loss for _, loss, _ in steps], "system_seconds": system_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--demonstrations", type=int, default=24,
                        help="demonstrated episodes: two rows each, 16 rows a step")
    args = parser.parse_args()
    runs = {setting: [] for setting in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="bench_cpu_allocator_") as work:
        demonstrations = prepare(work, args.demonstrations)
        for round_index in range(args.rounds):
            for setting in SETTINGS:
                output = os.path.join(work, f"sft_{round_index}_{len(runs[setting])}_"
                                            f"{SETTINGS.index(setting)}")
                runs[setting].append(run_sft(setting, demonstrations, output))
                figures = runs[setting][-1]
                print(f"round {round_index + 1}, {setting}: {figures['step_seconds']:.2f} s a "
                      f"step, {figures['system_seconds']:.1f} s system CPU", flush=True)
    losses = {tuple(run["losses"]) for setting in SETTINGS for run in runs[setting]}
    if len(losses) != 1:
        raise SystemExit(f"the settings trained differently: losses {losses}")
    baseline = statistics.median(run["step_seconds"] for run in runs[SETTINGS[0]])
    print("\n| malloc | s a step, per round | median | speed-up | system CPU s (median) |")
    print("|---|---|---:|---:|---:|")
    for setting in SETTINGS:
        seconds = [run["step_seconds"] for run in runs[setting]]
        system = statistics.median(run["system_seconds"] for run in runs[setting])
        print(f"| {setting} | {', '.join(f'{value:.2f}' for value in seconds)} | "
              f"{statistics.median(seconds):.2f} | {baseline / statistics.median(seconds):.2f}x "
              f"| {system:.1f} |")
    print(f"losses equal in every run: {', '.join(next(iter(losses)))}")


if __name__ == "__main__":
    main()
