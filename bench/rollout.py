"""Benchmark: both rollout engines vs transformers' `generate`, on the same model and requests.

    python bench/rollout.py [--rounds 3] [--prompts 16] [--prompt-tokens 32] [--new-tokens 64]

One process (world of 1, gloo/CPU or NCCL/GPU) holds a Llama-shaped model (~21M parameters,
4 layers, hidden 512, 8 heads of 64, vocab 8192) as a Megatron actor. The same weights go to
transformers' LlamaForCausalLM, to the Megatron engine (on the actor itself) and to vLLM (through
the resharder's full layout). Each round runs the three on the same prompts and sampling
(temperature 1, no stop tokens), alternating; the best round of each is reported as generated
tokens per second and as a ratio to transformers.

Also measured: the time of one weight update from the resharder into each engine (vLLM's
compared with its own cold start, the alternative to updating in place), and resident memory
before and after `sleep()`.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from mcore_rl.config import ModelConfig  # noqa: E402
from mcore_rl.config.rollout import PromptConfig, SamplingConfig  # noqa: E402
from mcore_rl.conversion.architectures import ARCHITECTURES  # noqa: E402
from mcore_rl.param_layout import sharding  # noqa: E402
from world import run_world  # noqa: E402

MODEL = ModelConfig(num_layers=4, hidden_size=512, ffn_hidden_size=1536, num_attention_heads=8,
                    num_kv_heads=4, vocab_size=8192, max_position_embeddings=512)
LLAMA = ARCHITECTURES["LlamaForCausalLM"]


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: (1 + 0.1 * torch.randn(shape, generator=generator)) if "norm" in name
            else 0.05 * torch.randn(shape, generator=generator)
            for name, shape in sharding.canonical_param_shapes(MODEL).items()}


def _hf_model(state: dict):
    import transformers

    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.hf_config(MODEL).items()
                                         if k not in ("architectures", "torch_dtype")})
    model = transformers.LlamaForCausalLM(config).eval()
    hf_state = {}
    for name, tensor in state.items():
        hf_state.update(LLAMA.from_canonical(name, tensor, MODEL))
    model.load_state_dict(hf_state, strict=True)
    return model


def _hf_generate(model, prompts, new_tokens: int) -> int:
    longest = max(map(len, prompts))
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding, as generate expects
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0,
                             temperature=1.0, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0)
    return (out.shape[1] - longest) * len(prompts)


def bench(args, out_path: str) -> None:
    from mcore_rl.config import BatchConfig, JobConfig, ParallelConfig
    from mcore_rl.models import build_gpt_model, load_full_state
    from mcore_rl.models.weights import local_parameters
    from mcore_rl.resharding import Resharder, build_plan, make_rollout_layout
    from mcore_rl.resharding.execute import megatron_training_layout
    from mcore_rl.rollout import MegatronEngine
    from mcore_rl.rollout.vllm_engine import VllmEngine
    from mcore_rl.rollout.vllm_start import VllmOptions, write_config_folder
    from mcore_rl.runtime import initialize

    parallel = ParallelConfig()
    context = args.prompt_tokens + args.new_tokens
    place = initialize(JobConfig(model=MODEL, parallel=parallel,
                                 batch=BatchConfig(global_batch_size=1, micro_batch_size=1,
                                                   seq_length=context))).training
    state = _state()
    actor = build_gpt_model(MODEL, parallel, "fp32", place=place)
    load_full_state(actor, state, MODEL)
    training = megatron_training_layout(MODEL, place)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, MODEL.vocab_size, (args.prompts, args.prompt_tokens),
                            generator=generator).tolist()
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    prompt_config = PromptConfig(max_prompt_tokens=args.prompt_tokens)
    results = {"params": sum(t.numel() for t in state.values())}

    started = time.perf_counter()
    vllm = VllmEngine(write_config_folder(MODEL, LLAMA, args.config_dir), LLAMA,
                      make_rollout_layout(training, "vllm", 1), context,
                      VllmOptions(dtype=torch.float32), place.dp_rank)
    results["vllm_start_s"] = time.perf_counter() - started
    to_full = Resharder(build_plan(training, make_rollout_layout(training, "full", 1),
                                   torch.float32))
    own_copy = build_gpt_model(MODEL, parallel, "fp32", place=place)
    own = MegatronEngine(own_copy, MODEL, context, own_weights=True, max_batch_size=args.prompts)
    to_megatron = Resharder(build_plan(training, make_rollout_layout(training, "megatron", 1),
                                       torch.float32))
    updates = {"vllm": lambda: vllm.update_weights(to_full.sync(local_parameters(actor))),
               "megatron": lambda: own.update_weights(to_megatron.sync(local_parameters(actor)))}
    results["update_s"] = {}
    for name, update in updates.items():
        times = []
        for _ in range(args.rounds):
            started = time.perf_counter()
            update()
            times.append(time.perf_counter() - started)
        results["update_s"][name] = min(times)

    hf = _hf_model(state)
    shared = MegatronEngine(actor, MODEL, context, max_batch_size=args.prompts)
    runners = {
        "transformers": lambda: _hf_generate(hf, prompts, args.new_tokens),
        "megatron": lambda: shared.generate(prompts, sampling,
                                            prompt_config).metrics["generated_tokens"],
        "vllm": lambda: vllm.generate(prompts, sampling,
                                      prompt_config).metrics["generated_tokens"],
    }
    for runner in runners.values():  # warm-up (vLLM's first batch pays one-time costs)
        runner()
    results["tokens_per_s"] = {name: 0.0 for name in runners}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            started = time.perf_counter()
            tokens = runner()
            rate = tokens / (time.perf_counter() - started)
            results["tokens_per_s"][name] = max(results["tokens_per_s"][name], rate)

    results["sleep_mb"] = {}
    for name, engine in (("vllm", vllm), ("megatron (own copy)", own)):
        before = _rss_mb()
        engine.sleep()
        after = _rss_mb()
        if engine.weights_survive_sleep:  # else the next sync brings them back
            engine.wake()
        results["sleep_mb"][name] = (before, after)
    results["device"] = str(next(actor.parameters()).device)
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    torch.save(results, out_path)


def report(results: dict, args) -> list[str]:
    rates = results["tokens_per_s"]
    lines = [f"model: {results['params'] / 1e6:.1f}M parameters fp32 on {results['device']}; "
             f"{args.prompts} prompts x {args.prompt_tokens} tokens, {args.new_tokens} new "
             f"tokens each, temperature 1; best of {args.rounds} alternating rounds", "",
             "| engine | generated tokens/s | vs transformers |", "|---|---:|---:|"]
    for name, rate in rates.items():
        lines.append(f"| {name} | {rate:.0f} | {rate / rates['transformers']:.2f}x |")
    lines += ["", "| weight update from the resharder | seconds | vs vLLM cold start |",
              "|---|---:|---:|"]
    for name, seconds in results["update_s"].items():
        lines.append(f"| {name} | {seconds:.3f} | {seconds / results['vllm_start_s']:.3f} |")
    lines.append(f"| (vLLM cold start, placeholder weights) | {results['vllm_start_s']:.1f} | 1 |")
    lines += ["", "| sleep | resident MB before | after |", "|---|---:|---:|"]
    for name, (before, after) in results["sleep_mb"].items():
        lines.append(f"| {name} | {before:.0f} | {after:.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        args.config_dir = os.path.join(folder, "engine_config")
        out = os.path.join(folder, "results.pt")
        run_world(1, bench, args, out)
        print("\n".join(report(torch.load(out), args)))


if __name__ == "__main__":
    main()
