"""Benchmark: CPU training steps with freed memory kept in the process vs glibc's defaults.

    OMP_NUM_THREADS=1 python bench/cpu_allocator.py [--rounds 3] [--steps 6]

runtime/cpu_compat.py sets glibc's malloc to keep freed blocks (up to 32 MiB) in the heap and
never trim it while a CPU run lives: by default every activation and logits tensor above
128 KiB is returned to the system when freed, and the next micro-batch faults in freshly zeroed
pages for it. Each round runs `mcore-rl smoke` (one rank, random tokens, a model of
SmolLM2-135M's shape, random weights) twice, the two settings alternating (MCORE_RL_CPU_MALLOC=
system for glibc's defaults); reported: the median step seconds of steps 2+ (the first step
builds the optimizer state) and the process's system CPU seconds, and their ratios.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2_SHAPE = ["model.num_layers=30", "model.hidden_size=576", "model.ffn_hidden_size=1536",
                 "model.num_attention_heads=9", "model.num_kv_heads=3", "model.vocab_size=49152",
                 "model.max_position_embeddings=2048", "model.tie_embeddings=true",
                 "parallel.tensor_model_parallel_size=1",
                 "parallel.pipeline_model_parallel_size=1"]
STEP_LINE = re.compile(r"^step (\d+): .* (\d+) tokens/s$", re.MULTILINE)


def run_smoke(setting: str, steps: int, seq_length: int) -> dict:
    """One `mcore-rl smoke` run: median tokens/s of steps 2+, wall and system CPU seconds."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT="29731", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                       LOCAL_WORLD_SIZE="1")
    if setting == "glibc defaults":
        environment["MCORE_RL_CPU_MALLOC"] = "system"
    command = [sys.executable, "-m", "mcore_rl", "smoke", "--config",
               os.path.join(REPO, "configs", "smoke.yaml"), *SMOLLM2_SHAPE,
               f"smoke.steps={steps}", f"batch.seq_length={seq_length}",
               "batch.global_batch_size=16", "batch.micro_batch_size=8",
               "runtime.precision=fp32"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"smoke ({setting}) failed:\n{result.stderr[-3000:]}")
    rates = [int(rate) for step, rate in STEP_LINE.findall(result.stdout) if int(step) >= 1]
    return {"tokens_per_second": statistics.median(rates), "wall": wall,
            "system_seconds": after.ru_stime - before.ru_stime}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-length", type=int, default=128)
    args = parser.parse_args()
    settings = ("glibc defaults", "kept (mcore_rl)")
    runs = {setting: [] for setting in settings}
    for round_index in range(args.rounds):
        for setting in settings:
            runs[setting].append(run_smoke(setting, args.steps, args.seq_length))
            figures = runs[setting][-1]
            print(f"round {round_index + 1} {setting}: {figures['tokens_per_second']} tokens/s, "
                  f"{figures['system_seconds']:.1f} s system CPU", flush=True)
    baseline = statistics.median(run["tokens_per_second"] for run in runs[settings[0]])
    print(f"\n| malloc | tokens/s per round | median | ratio | system CPU s (median) |")
    print("|---|---|---:|---:|---:|")
    for setting in settings:
        rates = [run["tokens_per_second"] for run in runs[setting]]
        system = statistics.median(run["system_seconds"] for run in runs[setting])
        print(f"| {setting} | {', '.join(str(rate) for rate in rates)} | "
              f"{statistics.median(rates)} | {statistics.median(rates) / baseline:.2f}x | "
              f"{system:.1f} |")


if __name__ == "__main__":
    main()
