"""Benchmark: peak memory of the log-prob pass (log-probs and entropy of every response token,
forward and backward) against sequence length, chunked against the autograd implementation it
replaced (issue 48).

    OMP_NUM_THREADS=1 .venv/bin/python bench/long_context.py [--lengths 1024,2048,4096]
        [--vocab 32000] [--cap-gb 8] [--device cuda]

Every measurement is a fresh process: logits [length, vocab] (one TP rank's slice, TP1; fp32 on
the CPU, bf16 on a GPU, where the peak is the allocator's and the pass is also timed) and
targets, then log-probs and entropy, a weighted sum of both, and its gradient with respect to
the logits, as the actor's update takes them. The peak resident memory above what the logits
and their gradient occupy (each [length, vocab]) is what the pass itself costs. Variants:

    autograd     the implementation before issue 48 (below, unchanged): autograd through the
                 upcast, the shift, exp and the gathers, over the whole sequence
    one-chunk    models/logprobs.py with every position in one chunk
    chunked      models/logprobs.py as the trainer calls it (CHUNK_TOKENS positions per chunk)

The table gives the extra peak per variant and length, the ratio to autograd's, and the longest
sequence whose pass fits --cap-gb beside its logits and gradient (from the per-token slope).
Context parallelism divides the tokens per rank: bench/long_context_cp.py measures a model at CP1
and CP2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

VARIANTS = ("autograd", "one-chunk", "chunked")


def autograd_logprobs(logits, targets, vocab_size):
    """The log-prob pass before issue 48, at TP1 (its all-reduces are then the identity)."""
    import torch

    logits = logits.float()
    is_real = torch.arange(logits.shape[-1], device=logits.device) < vocab_size
    if not bool(is_real.all()):
        logits = logits.masked_fill(~is_real, float("-inf"))
    with torch.no_grad():
        max_logit = logits.max(dim=-1).values
    shifted = logits - max_logit.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    log_sum_exp = sum_exp.log()
    target_logit = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    expected_logit = (exp * shifted).sum(dim=-1) / sum_exp
    return target_logit - log_sum_exp, log_sum_exp - expected_logit


def child(variant: str, length: int, vocab: int, device: str) -> dict:
    """One measurement in this process."""
    import time

    import torch

    from mcore_rl.models.logprobs import CHUNK_TOKENS, vocab_parallel_logprobs_and_entropy

    gpu = device == "cuda"
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(length, vocab, generator=generator).to(
        device, torch.bfloat16 if gpu else torch.float32).requires_grad_(True)
    targets = torch.randint(0, vocab, (length,), generator=generator).to(device)
    weights = torch.randn(2, length, generator=generator).to(device)
    logits_mb = logits.numel() * logits.element_size() / 2 ** 20
    if gpu:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated() / 2 ** 20
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _resident_mb("VmRSS")
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # the peak (VmHWM) starts again from here
    started = time.perf_counter()
    if variant == "autograd":
        logprobs, entropy = autograd_logprobs(logits, targets, vocab)
    else:
        chunk = length if variant == "one-chunk" else CHUNK_TOKENS
        logprobs, entropy = vocab_parallel_logprobs_and_entropy(logits, targets, vocab,
                                                                chunk_tokens=chunk)
    (weights[0] * logprobs + weights[1] * entropy).sum().backward()
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2 ** 20 if gpu else _resident_mb("VmHWM")
    return {"extra_mb": peak - base - logits_mb, "logits_mb": logits_mb, "seconds": seconds}


def _resident_mb(field: str) -> float:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith(field)) / 1024


def measure(variant: str, length: int, vocab: int, device: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", variant, str(length), str(vocab),
                           device], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode != 0:  # out of memory, most likely: the table says so
        return {"failed": done.stderr.strip().splitlines()[-1][:80]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--cap-gb", type=float, default=8.0)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, length, vocab, device = args.child
        print(json.dumps(child(variant, int(length), int(vocab), device)))
        return
    lengths = [int(length) for length in args.lengths.split(",")]
    rows = {(variant, length): measure(variant, length, args.vocab, args.device)
            for length in lengths for variant in VARIANTS}
    dtype = "bf16" if args.device == "cuda" else "fp32"
    print(f"vocabulary {args.vocab}, {dtype} logits on {args.device}; extra peak MB of the pass "
          "(x autograd's), seconds\n")
    print("| tokens | logits MB | " + " | ".join(VARIANTS) + " |")
    print("|---|---|" + "---|" * len(VARIANTS))
    for length in lengths:
        reference = rows["autograd", length].get("extra_mb")
        cells = [_cell(rows[variant, length], reference) for variant in VARIANTS]
        logits_mb = length * args.vocab * (2 if args.device == "cuda" else 4) / 2 ** 20
        print(f"| {length} | {logits_mb:.0f} | " + " | ".join(cells) + " |")
    longest, shortest = lengths[-1], lengths[0]
    print(f"\nlongest sequence whose pass fits {args.cap_gb} GB beside its logits and gradient:")
    for variant in VARIANTS:
        first, last = rows[variant, shortest], rows[variant, longest]
        if "failed" in first or "failed" in last:
            continue
        slope = (last["extra_mb"] - first["extra_mb"]) / (longest - shortest)
        fixed = first["extra_mb"] - slope * shortest
        per_token = slope + 2 * last["logits_mb"] / longest  # its own, the logits, the gradient
        print(f"  {variant:10s} {fixed:8.0f} MB + {slope:.3f} MB per token of its own -> "
              f"{int((args.cap_gb * 1024 - fixed) / per_token):,} tokens")


def _cell(row: dict, reference) -> str:
    if "failed" in row:
        return f"failed: {row['failed']}"
    ratio = f" ({row['extra_mb'] / reference:.2f})" if reference else ""
    return f"{row['extra_mb']:.0f}{ratio}, {row['seconds']:.2f} s"


if __name__ == "__main__":
    main()
