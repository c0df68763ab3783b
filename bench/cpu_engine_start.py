"""Benchmark: a vLLM engine's start and first generates on a CPU, as the rollout engine sets it
up against vLLM's own CPU defaults (issue 43).

    OMP_NUM_THREADS=1 .venv/bin/python bench/cpu_engine_start.py [--rounds 3]

Every measurement is a fresh process, a world of one rank (what each test world, job and launch
pays): start a vLLM engine for the toy job's model (configs/grpo_toy.yaml), generate twice
(128 prompts x 4 sampled tokens with their log-probs, as the trainer asks). Variants:

    engine         the rollout engine as it is: a KV cache for what vLLM's scheduler can fill
                   (rollout/vllm_start.py), torch.compile'd functions run as written
                   (runtime/cpu_compat.py)
    vllm-defaults  vLLM's own CPU behaviour: a KV cache of gpu_memory_utilization x the host's
                   memory, zeroed at start (and a warm-up forward), and its sampler's log-prob
                   op built by inductor's C++ compiler in the process

The table gives each phase's median over --rounds (variants alternate), and the ratio of the
engine's to vLLM's defaults per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("engine", "vllm-defaults")
PHASES = ("start", "first generate", "second generate", "process")


def child(variant: str, folder: str) -> dict:
    """One measurement in this process (a world of one rank)."""
    started = time.perf_counter()
    import torch

    from mcore_rl.config import BatchConfig, JobConfig, ModelConfig, RuntimeConfig
    from mcore_rl.config.rollout import PromptConfig, SamplingConfig
    from mcore_rl.conversion.architectures import ARCHITECTURES
    from mcore_rl.resharding import RolloutLayout
    from mcore_rl.rollout import vllm_engine, vllm_start
    from mcore_rl.runtime import initialize, shutdown

    model = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256,
                        num_attention_heads=2, num_kv_heads=2, vocab_size=16,
                        max_position_embeddings=64)
    initialize(JobConfig(model=model, batch=BatchConfig(global_batch_size=1, micro_batch_size=1,
                                                        seq_length=12),
                         runtime=RuntimeConfig(collective_timeout_minutes=5)))
    if variant == "vllm-defaults":
        torch._dynamo.config.disable = False
        vllm_start._cpu_kv_cache_bytes = lambda *args: None
    architecture = ARCHITECTURES["LlamaForCausalLM"]
    vllm_start.write_config_folder(model, architecture, folder)
    times = {}
    mark = time.perf_counter()
    engine = vllm_engine.VllmEngine(
        folder, architecture, RolloutLayout.consecutive(model, "vllm", 1, 1), 12,
        vllm_start.VllmOptions(dtype=torch.float32, gpu_memory_utilization=0.4), data_shard=0)
    times["start"] = time.perf_counter() - mark
    prompts = [[2, 3 + index % 10] for index in range(128)]
    sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=4, seed=1)
    for phase in ("first generate", "second generate"):
        mark = time.perf_counter()
        engine.generate(prompts, sampling, PromptConfig(max_prompt_tokens=8))
        times[phase] = time.perf_counter() - mark
    times["process"] = time.perf_counter() - started
    shutdown()
    return times


def measure(variant: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="mcore_rl-bench-") as folder:
        environment = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                           LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(29000 + os.getpid() % 1000), OMP_NUM_THREADS="1")
        environment.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vLLM's override would win over both
        done = subprocess.run([sys.executable, __file__, "--child", variant, folder],
                              env=environment, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise SystemExit(f"{variant} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        print(json.dumps(child(*arguments.child)))
        return
    runs = {variant: [] for variant in VARIANTS}
    for round_ in range(arguments.rounds):
        for variant in VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]:
            runs[variant].append(measure(variant))
    median = {variant: {phase: statistics.median(run[phase] for run in runs[variant])
                        for phase in PHASES} for variant in VARIANTS}
    print(f"{'phase (median of ' + str(arguments.rounds) + ', s)':32s}"
          + "".join(f"{variant:>15s}" for variant in VARIANTS) + f"{'ratio':>8s}")
    for phase in PHASES:
        engine, defaults = median["engine"][phase], median["vllm-defaults"][phase]
        print(f"{phase:32s}{engine:15.2f}{defaults:15.2f}{engine / defaults:8.2f}")


if __name__ == "__main__":
    main()
