"""Benchmark: token-budget micro-batches vs fixed-size ones for an update on long-tail lengths.

    python bench/micro_batching.py [--rounds 3] [--rows 64] [--max-length 512]

RL responses have a long tail: most are short, a few run to the length limit. Fixed micro-batches
of `micro_batch_size` rows pad every row to the batch's longest; token-budget micro-batches
(actor.max_tokens_per_micro_batch) sort rows by length and cut each micro-batch to its own
longest row. One process (world of 1) holds a Llama-shaped model (~21M parameters) and runs
forward (log-probs) + one training step on the same batch both ways, alternating, for several
rounds. Reported: padded tokens computed, the best round's seconds, and the ratio to fixed.
The budget is micro_batch_size x max_length, so both hold the same tokens at most per
micro-batch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

import torch  # noqa: E402

from world import run_world  # noqa: E402

MICRO_BATCH_SIZE = 4


def long_tail_batch(rows: int, max_length: int, vocab: int, seed: int = 0) -> dict:
    """Prompt+response lengths from an exponential with mean max_length/5, clipped."""
    generator = torch.Generator().manual_seed(seed)
    lengths = (torch.empty(rows).exponential_(generator=generator) * max_length / 5)
    lengths = lengths.long().clamp(16, max_length)
    mask = (torch.arange(max_length)[None] < lengths[:, None]).long()
    ids = torch.randint(0, vocab, (rows, max_length), generator=generator) * mask
    return {"input_ids": ids, "attention_mask": mask}


def _rank(args) -> None:
    from mcore_rl.config import JobConfig, ModelConfig, OptimizerConfig
    from mcore_rl.models import build_gpt_model
    from mcore_rl.runtime import initialize, shutdown
    from mcore_rl.smoke import next_token_loss
    from mcore_rl.training import compute_outputs, make_trainable, train_step
    from mcore_rl.training.batches import token_budget_micro_batches

    model = ModelConfig(num_layers=4, hidden_size=512, ffn_hidden_size=1536,
                        num_attention_heads=8, num_kv_heads=4, vocab_size=8192,
                        max_position_embeddings=args.max_length)
    config = JobConfig(model=model, optimizer=OptimizerConfig(lr=1e-5))
    place = initialize(config).training
    trainable = make_trainable(build_gpt_model(model, config.parallel, place=place),
                               config.optimizer, "fp32")
    batch = long_tail_batch(args.rows, args.max_length, model.vocab_size)
    budget = MICRO_BATCH_SIZE * args.max_length
    width = int(batch["attention_mask"].sum(1).max())
    batch = {name: tensor[:, :width] for name, tensor in batch.items()}
    micro_batches, _ = token_budget_micro_batches(batch, budget)
    computed = {"fixed": batch["input_ids"].numel(),
                "budget": sum(m["input_ids"].numel() for m in micro_batches)}
    best = {"fixed": float("inf"), "budget": float("inf")}
    for _ in range(args.rounds):
        for name, max_tokens in (("fixed", 0), ("budget", budget)):
            start = time.perf_counter()
            compute_outputs(trainable.chunks, batch, MICRO_BATCH_SIZE, "lm", model.vocab_size,
                            max_tokens=max_tokens)
            train_step(trainable, batch, MICRO_BATCH_SIZE, next_token_loss, "lm",
                       model.vocab_size, max_tokens=max_tokens)
            best[name] = min(best[name], time.perf_counter() - start)
    real = int(batch["attention_mask"].sum())
    print(f"{args.rows} rows, {real} real tokens, longest {width}; budget {budget} tokens "
          f"(= {MICRO_BATCH_SIZE} rows x {args.max_length})")
    print(f"{'micro-batching':<16}{'micro-batches':>14}{'tokens computed':>17}{'padding':>9}"
          f"{'seconds':>9}{'vs fixed':>10}")
    counts = {"fixed": args.rows // MICRO_BATCH_SIZE, "budget": len(micro_batches)}
    for name in ("fixed", "budget"):
        print(f"{name:<16}{counts[name]:>14}{computed[name]:>17}"
              f"{1 - real / computed[name]:>9.0%}{best[name]:>9.2f}"
              f"{best['fixed'] / best[name]:>9.2f}x")
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=512)
    run_world(1, _rank, parser.parse_args())


if __name__ == "__main__":
    main()
