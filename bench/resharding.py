"""Benchmark: our resharder vs the full-gather sync peers use, in the same gloo worlds.

    python bench/resharding.py [--repeats 3] [--bucket-mb 64]

A Llama-shaped model of ~58M parameters (fp32, 8 layers, hidden 512, 8 heads / 4 KV heads,
vocab 32000, untied) is cut into training shards on every rank; each layout pair is synced to
vLLM's layout (fixed consecutive grouping) and to Megatron's layout (planned grouping) by both
implementations, alternating, best of ``--repeats``. Every delivered tensor is checked bitwise
against the reference slice before timing counts.

Reported per pair: bytes received per rank (max over ranks) for ours (measured: the receive
buffers posted), full-gather (logical bytes of its all-gather + broadcast) and the lower bound;
wall time of the slowest rank for both; peak extra resident memory during the sync (sampled
from /proc every millisecond, large allocations forced to mmap so that freed memory is
returned and the peak is visible).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mcore_rl.config import ModelConfig  # noqa: E402
from mcore_rl.param_layout import sharding  # noqa: E402
from mcore_rl.resharding import (Resharder, TrainingLayout, build_plan,  # noqa: E402
                                 make_rollout_layout)
from mcore_rl.resharding.full_gather import FullGatherSync, full_gather_transfers  # noqa: E402
from mcore_rl.resharding.plan import lower_bound_received, traffic_of  # noqa: E402
from mcore_rl.runtime.memory import PeakMemory  # noqa: E402
from world import run_world  # noqa: E402

MODEL = ModelConfig(num_layers=8, hidden_size=512, ffn_hidden_size=1536, num_attention_heads=8,
                    num_kv_heads=4, vocab_size=32000, max_position_embeddings=512,
                    tie_embeddings=False)
PAIRS = {
    4: [((2, 2, 1), 2), ((2, 2, 1), 4), ((1, 4, 1), 2)],
    8: [((4, 2, 1), 2), ((2, 2, 2), 4)],
}
"""World size -> [(training TP, PP, DP), rollout TP)]."""
ENGINES = ("vllm", "megatron")


def _drain(stream) -> None:
    for _name, tensor in stream:
        del tensor


def _timed(sync, local) -> tuple[float, int]:
    dist.barrier()
    with PeakMemory() as peak:
        start = time.perf_counter()
        _drain(sync.sync(local))
        seconds = time.perf_counter() - start
    return seconds, peak.extra_bytes


def _verify(sync, local, full, rollout) -> None:
    wanted = {spec.name: spec for spec in rollout.wanted(dist.get_rank()).values()}
    for name, tensor in sync.sync(local):
        if not torch.equal(tensor, wanted[name].cut(full[wanted[name].source])):
            raise AssertionError(f"rank {dist.get_rank()}: {name} differs from the reference")


def bench_world(pairs, repeats: int, bucket_bytes: int, out_path: str) -> None:
    dist.init_process_group("gloo")
    generator = torch.Generator().manual_seed(0)
    full = {name: torch.randn(shape, generator=generator)
            for name, shape in sharding.canonical_param_shapes(MODEL).items()}
    rows = []
    for training_dims, rollout_tp in pairs:
        layout = TrainingLayout(MODEL, *training_dims)
        tp_rank, pp_rank, _ = layout.coordinates(dist.get_rank())
        local = sharding.shard_full_state(full, MODEL, layout.tp, layout.pp, tp_rank, pp_rank)
        for engine in ENGINES:
            rollout = make_rollout_layout(layout, engine, rollout_tp)
            ours = Resharder(build_plan(layout, rollout, torch.float32), bucket_bytes)
            baseline = FullGatherSync(layout, rollout)
            _verify(ours, local, full, rollout)
            _verify(baseline, local, full, rollout)
            times = {"ours": [], "full": []}
            memory = {"ours": 0, "full": 0}
            for _ in range(repeats):
                for key, sync in (("ours", ours), ("full", baseline)):
                    seconds, extra = _timed(sync, local)
                    times[key].append(seconds)
                    memory[key] = max(memory[key], extra)
            found = [None] * dist.get_world_size()
            dist.all_gather_object(found, (min(times["ours"]), min(times["full"]),
                                           ours.received_bytes, memory["ours"], memory["full"]))
            rows.append((training_dims, engine, rollout, found))
    if dist.get_rank() == 0:
        torch.save(rows, out_path)
    dist.destroy_process_group()


def _mb(value: float) -> str:
    return f"{value / 2 ** 20:.1f}"


def report(rows) -> list[str]:
    lines = []
    for training_dims, engine, rollout, found in rows:
        layout = TrainingLayout(MODEL, *training_dims)
        world = layout.world_size
        ours_time = max(f[0] for f in found)
        full_time = max(f[1] for f in found)
        ours_bytes = max(f[2] for f in found)
        full_bytes = traffic_of(full_gather_transfers(layout), world, 4).received.max()
        lower = lower_bound_received(layout, rollout, 4).max()
        tp, pp, dp = training_dims
        lines.append(
            f"| {world} | TP{tp}PP{pp}DP{dp} -> TP{rollout.tp}DP{rollout.dp} | {engine} | "
            f"{_mb(ours_bytes)} / {_mb(full_bytes)} / {_mb(lower)} | "
            f"{ours_bytes / lower:.2f} | {ours_bytes / full_bytes:.2f} | "
            f"{ours_time:.2f} / {full_time:.2f} | {full_time / ours_time:.1f}x | "
            f"{_mb(max(f[3] for f in found))} / {_mb(max(f[4] for f in found))} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=64)
    args = parser.parse_args()
    params = sum(int(torch.Size(s).numel())
                 for s in sharding.canonical_param_shapes(MODEL).values())
    print(f"model: {params / 1e6:.1f}M parameters, {_mb(params * 4)} MB fp32; bucket "
          f"{args.bucket_mb} MB; best of {args.repeats}")
    print("| world | layout pair | engine | max MB received: ours / full-gather / lower bound "
          "| ours / lower bound | ours / full-gather | seconds: ours / full-gather | speed-up | "
          "peak extra MB: ours / full-gather |")
    print("|---:|---|---|---|---:|---:|---|---:|---|")
    for world, pairs in PAIRS.items():
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.pt")
            run_world(world, bench_world, pairs, args.repeats, int(args.bucket_mb * 2 ** 20), out)
            print("\n".join(report(torch.load(out, weights_only=False))), flush=True)


if __name__ == "__main__":
    main()
