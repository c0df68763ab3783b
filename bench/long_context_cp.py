"""Benchmark: peak memory per rank of a small model's log-prob pass and of an update, against
sequence length, at context parallelism 1 and 2 (issue 48).

    OMP_NUM_THREADS=1 .venv/bin/python bench/long_context_cp.py [--lengths 2048,4096,8192,16384]
        [--cap-gb 4]

Each measurement is a fresh world (one process per rank, gloo, fp32 on the CPU): a 2-layer
model (hidden 256, 4 heads, vocabulary 8192) with random weights, one sequence of `length`
tokens. On every rank the peak resident memory above what it held before the pass (model,
optimizer, batch) is read (VmHWM, reset first) for the forward-only log-prob pass
(`compute_outputs`) and for one `train_step` (forward, backward, Adam); the table gives the
largest rank's, and the ratio CP2 / CP1. From the per-token slope of the longest two lengths,
the longest sequence whose update fits --cap-gb per rank.

The log-probs of one rank's chunks are computed in chunks of positions already
(models/logprobs.py, `bench/long_context.py`): what CP divides here is the rest, the
activations of the transformer and the logits of the rank's positions.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

LAYOUTS = (1, 2)


def rank_main(rank: int, world: int, port: int, length: int) -> None:
    """One rank: build, measure both passes, print its peaks as JSON."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    from long_context import _resident_mb  # bench/ is this script's own folder on sys.path

    from mcore_rl.config import (BatchConfig, JobConfig, ModelConfig, OptimizerConfig,
                                 ParallelConfig, RuntimeConfig)
    from mcore_rl.models import build_gpt_model
    from mcore_rl.runtime import initialize, shutdown
    from mcore_rl.training import compute_outputs, make_trainable, train_step

    model = ModelConfig(num_layers=2, hidden_size=256, ffn_hidden_size=768,
                        num_attention_heads=4, num_kv_heads=4, vocab_size=8192,
                        max_position_embeddings=length)
    parallel = ParallelConfig(context_parallel_size=world)
    optimizer = OptimizerConfig(lr=1e-4)
    config = JobConfig(model=model, parallel=parallel, optimizer=optimizer,
                       batch=BatchConfig(global_batch_size=1, micro_batch_size=1,
                                         seq_length=length),
                       runtime=RuntimeConfig(collective_timeout_minutes=10,
                                             output_dir=f"/tmp/long_context_cp_{os.getpid()}"))
    place = initialize(config).training
    trainable = make_trainable(build_gpt_model(model, parallel, "fp32", place=place), optimizer,
                               "fp32")
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, model.vocab_size, (1, length), generator=generator),
             "attention_mask": torch.ones(1, length, dtype=torch.long)}

    def loss(outputs, micro_batch):
        mask = micro_batch["attention_mask"]
        return -(outputs["logprobs"] * mask).sum(), mask.sum(), {}

    peaks = {}
    for name, run in (("logprob_pass", lambda: compute_outputs(
            trainable.chunks, batch, 1, "lm", model.vocab_size)),
                      ("update", lambda: train_step(trainable, batch, 1, loss, "lm",
                                                    model.vocab_size))):
        base = _resident_mb("VmRSS")
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # the peak (VmHWM) starts again from here
        run()
        peaks[name] = _resident_mb("VmHWM") - base
    print(json.dumps(peaks), flush=True)
    shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(cp: int, length: int) -> dict:
    """The largest rank's peaks in a fresh world of `cp` ranks."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank), str(cp), str(port),
                               str(length)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for rank in range(cp)]
    results = [rank.communicate() for rank in ranks]
    if any(rank.returncode for rank in ranks):
        return {"failed": next(err for (_, err), rank in zip(results, ranks)
                               if rank.returncode).strip().splitlines()[-1][:80]}
    peaks = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    return {name: max(peak[name] for peak in peaks) for name in peaks[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,4096,8192,16384")
    parser.add_argument("--cap-gb", type=float, default=4.0)
    parser.add_argument("--rank", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(*args.rank)
        return
    lengths = [int(length) for length in args.lengths.split(",")]
    rows = {(cp, length): measure(cp, length) for length in lengths for cp in LAYOUTS}
    print("peak MB per rank above the model and optimizer (largest rank); CP2 / CP1\n")
    print("| tokens | log-prob pass CP1 | CP2 | update CP1 | CP2 |")
    print("|---|---|---|---|---|")
    for length in lengths:
        cells = []
        for name in ("logprob_pass", "update"):
            one, two = rows[1, length], rows[2, length]
            if "failed" in one or "failed" in two:
                cells += [one.get("failed", f"{one.get(name, 0):.0f}"),
                          two.get("failed", f"{two.get(name, 0):.0f}")]
                continue
            cells += [f"{one[name]:.0f}", f"{two[name]:.0f} ({two[name] / one[name]:.2f})"]
        print(f"| {length} | " + " | ".join(cells) + " |")
    if len(lengths) > 1:
        shorter, longer = lengths[-2], lengths[-1]
        print(f"\nlongest sequence whose update fits {args.cap_gb} GB per rank (linear from "
              f"{shorter} and {longer} tokens):")
        for cp in LAYOUTS:
            first, last = rows[cp, shorter], rows[cp, longer]
            if "failed" in first or "failed" in last:
                continue
            slope = (last["update"] - first["update"]) / (longer - shorter)
            fixed = last["update"] - slope * longer
            print(f"  CP{cp}: {slope:.3f} MB per token -> "
                  f"{int((args.cap_gb * 1024 - fixed) / slope):,} tokens")


if __name__ == "__main__":
    main()
