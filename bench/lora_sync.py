"""Benchmark: the two ways an RL step can bring LoRA-trained weights into vLLM, on SmolLM2-135M.

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python bench/lora_sync.py [--rank 16]

* merged (what mcore_rl does): the resharder sends each rollout rank W + (alpha/r) B A for its
  shard; generation then runs the plain model. Bytes = the whole model; its seconds are the
  RL step's `time/reshard` (bench/trl_grpo.py's `reshard` phase), printed here from --metrics.
* adapter: vLLM started with enable_lora; every step writes the adapter (peft format, rank 0)
  and generates with a LoRARequest that reloads it (load_inplace). Bytes = the adapter; every
  forward pass then adds the LoRA kernels (punica; on CPU vLLM also turns torch.compile off).

Both engines generate the same work: --prompts prompts x --n samples of exactly --tokens tokens
(ignore_eos), fp32, eager, --steps times (the first is left out of the medians). The table
gives each path's bytes, load and generate seconds, and the step-time ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SMOLLM2_FOLDER = os.path.join(REPO, "runs", "models", "smollm2-135m-instruct")


def write_adapter(folder: str, model_dir: str, rank: int, seed: int) -> int:
    """A random (non-zero) peft adapter on every linear of the model; returns its bytes."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.01 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(folder)
    return os.path.getsize(os.path.join(folder, "adapter_model.safetensors"))


def timed_generations(llm, prompts, params, steps: int, lora=None) -> list[float]:
    seconds = []
    for step in range(steps):
        request = lora(step) if lora else None
        started = time.perf_counter()
        llm.generate(prompts, params, lora_request=request, use_tqdm=False)
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--metrics", nargs="*", default=[],
                        help="metrics.jsonl of RL runs whose time/reshard to print beside")
    args = parser.parse_args()

    from safetensors import safe_open
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    if not os.path.isdir(SMOLLM2_FOLDER):
        from mcore_rl.conversion.gguf_to_hf import gguf_to_hf, smollm2_gguf_path
        gguf_to_hf(smollm2_gguf_path(), SMOLLM2_FOLDER)
    model_bytes = 0
    for name in os.listdir(SMOLLM2_FOLDER):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(SMOLLM2_FOLDER, name), "pt") as tensors:
                model_bytes += sum(tensors.get_tensor(key).numel() * 4 for key in tensors.keys())
    prompts = [{"prompt_token_ids": [1, 100 + i, 200 + i, 300 + i, 400 + i]}
               for i in range(args.prompts)]
    params = SamplingParams(n=args.n, max_tokens=args.tokens, ignore_eos=True, temperature=1.0,
                            seed=0)
    common = dict(model=SMOLLM2_FOLDER, dtype="float32", enforce_eager=True, max_model_len=512,
                  enable_prefix_caching=False, seed=0)
    results = {}
    llm = LLM(**common)
    results["merged"] = timed_generations(llm, prompts, params, args.steps)
    del llm
    work = tempfile.mkdtemp(prefix="lora_sync_")
    adapter_bytes = write_adapter(os.path.join(work, "adapter_0"), SMOLLM2_FOLDER, args.rank, 0)
    llm = LLM(**common, enable_lora=True, max_lora_rank=args.rank, max_loras=1)
    writes = []

    def lora(step):
        folder = os.path.join(work, f"adapter_{step}")
        started = time.perf_counter()
        if step:  # a new adapter each step, as after an optimizer step
            write_adapter(folder, SMOLLM2_FOLDER, args.rank, step)
        writes.append(time.perf_counter() - started)
        return LoRARequest("policy", 1, folder, load_inplace=True)

    results["adapter"] = timed_generations(llm, prompts, params, args.steps, lora)
    reshard = []
    for path in args.metrics:
        with open(path) as handle:
            reshard += [json.loads(line)["time/reshard"] for line in handle if line.strip()][1:]
    merged_sync = statistics.median(reshard) if reshard else float("nan")
    generate = {name: statistics.median(values[1:]) for name, values in results.items()}
    print(f"SmolLM2-135M, {args.prompts} prompts x {args.n} samples x {args.tokens} tokens, "
          f"fp32, eager, CPU; adapter rank {args.rank} on every linear; medians of steps "
          f"2..{args.steps}")
    print(f"{'path':<9}{'bytes moved':>13}{'sync s':>9}{'generate s':>12}{'sum s':>8}")
    print(f"{'merged':<9}{model_bytes / 2 ** 20:>10.1f} MB{merged_sync:>9.2f}"
          f"{generate['merged']:>12.2f}{merged_sync + generate['merged']:>8.2f}")
    adapter_sync = statistics.median(writes[1:])
    print(f"{'adapter':<9}{adapter_bytes / 2 ** 20:>10.1f} MB{adapter_sync:>9.2f}"
          f"{generate['adapter']:>12.2f}{adapter_sync + generate['adapter']:>8.2f}  (sync: "
          "writing the peft folder; vLLM's reload is inside generate)")
    print(f"merged / adapter step-time ratio (> 1: adapter faster): "
          f"{(merged_sync + generate['merged']) / (adapter_sync + generate['adapter']):.2f}x")


if __name__ == "__main__":
    main()
