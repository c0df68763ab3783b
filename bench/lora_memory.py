"""Table: per-GPU static training state of RL on Llama-3-8B and -70B, full fine-tuning against
LoRA, and the fewest 80 GB GPUs each fits on (mcore_rl.training.memory_plan).

    .venv/bin/python bench/lora_memory.py [--rank 16] [--gpu-gb 80] [--headroom 0.35]

"Fits" leaves --headroom of the GPU to activations, the engine's KV cache and the framework.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from mcore_rl.config import load_config  # noqa: E402
from mcore_rl.config.lora import LoraConfig  # noqa: E402
from mcore_rl.training.memory_plan import (adapter_parameters, model_parameters,  # noqa: E402
                                           training_memory)

MODELS = {"Llama-3-8B": ("llama3-8b.yaml", (1, 2, 4, 8)),
          "Llama-3-70B": ("llama3-70b.yaml", (4, 8, 16, 32, 64))}
"""Models and the GPU counts shown; the model is split over TP = min(GPUs, 8) x PP (PP so
that one replica fits, data parallelism over the rest)."""


def layouts(gpus: int, model_parallel_options=(1, 2, 4, 8, 16, 32)) -> list[int]:
    return [size for size in model_parallel_options if size <= gpus and gpus % size == 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--gpu-gb", type=float, default=80.0)
    parser.add_argument("--headroom", type=float, default=0.35)
    args = parser.parse_args()
    lora = LoraConfig(enabled=True, rank=args.rank)
    budget = args.gpu_gb * (1 - args.headroom) * 1e9
    print(f"static training state per GPU (GB): bf16 weights, fp32 grads, fp32 master + Adam "
          f"sharded over DP, bf16 reference (full) / adapters off (LoRA r{args.rank}, all "
          f"linears); fits = under {args.gpu_gb * (1 - args.headroom):.0f} GB")
    print(f"{'model':<13}{'GPUs':>5}{'full: TPxPP':>12}{'GB':>7}{'LoRA: TPxPP':>12}{'GB':>7}"
          "  fits")
    for name, (path, gpu_counts) in MODELS.items():
        model = load_config(os.path.join(REPO, "configs", "models", path)).model
        share = adapter_parameters(model, lora) / model_parameters(model)
        for gpus in gpu_counts:
            best = {}
            for mode, adapters in (("full", None), ("LoRA", lora)):
                # the smallest model split that fits (less TP x PP keeps the step fast)
                options = [(split, training_memory(model, adapters, split, gpus // split).total)
                           for split in layouts(gpus)]
                fitting = [option for option in options if option[1] <= budget]
                best[mode] = fitting[0] if fitting else min(options, key=lambda o: o[1])
            fits = [mode for mode in best if best[mode][1] <= budget]
            print(f"{name:<13}{gpus:>5}{best['full'][0]:>12}{best['full'][1] / 1e9:>7.1f}"
                  f"{best['LoRA'][0]:>12}{best['LoRA'][1] / 1e9:>7.1f}  "
                  f"{', '.join(fits) or '-'}")
        print(f"{'':<13}adapters: {share:.2%} of {model_parameters(model) / 1e9:.2f}B parameters")


if __name__ == "__main__":
    main()
