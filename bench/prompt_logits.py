"""Benchmark: the output layer over the response positions only vs over every position.

    python bench/prompt_logits.py [--rounds 2] [--rows 16]

An RL batch needs log-probs of its response tokens only. With packed micro-batches (the
default token budget) each micro-batch holds several rows back to back, so their prompts lie
between the responses; the output layer (the LM head and its log-softmax over the vocabulary)
then runs over the response positions alone (`output_mask`, training/forward_backward.py's
`_UsedOutputs`). One process (world of 1) holds a model of SmolLM2-135M's shape (random
weights: 30 layers, hidden 576, vocabulary 49,152) and runs the log-prob pass and one training
step on the same batch both ways, alternating, for several rounds: rows shaped like the TRL
bench's (prompts of 30-60 tokens, responses of 20-128), the default budget (2 rows x 256
tokens). Reported: the output layer's positions, the best round's seconds, and the ratio.
Measured 2026-11-29 (AMD EPYC, avx2, 1 thread): 1,965 tokens, 1,188 of them response tokens:
61.5 s every position, 51.6 s responses only (1.19x), 6 min for 3 rounds.
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

MAX_LENGTH = 256
BUDGET = 2 * MAX_LENGTH


def rl_batch(rows: int, vocab: int, seed: int = 0) -> dict:
    """Rows of a 30-60 token prompt and a 20-128 token response, right-padded."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(30, 61, (rows,), generator=generator)
    responses = torch.randint(20, 129, (rows,), generator=generator)
    lengths = prompts + responses
    columns = torch.arange(int(lengths.max()))[None]
    mask = (columns < lengths[:, None]).long()
    ids = torch.randint(0, vocab, mask.shape, generator=generator) * mask
    response_mask = mask * (columns >= prompts[:, None])
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": response_mask}


def _rank(args) -> None:
    from mcore_rl.config import JobConfig, ModelConfig, OptimizerConfig
    from mcore_rl.models import build_gpt_model
    from mcore_rl.runtime import initialize, shutdown
    from mcore_rl.sft.trainer import sft_loss
    from mcore_rl.training import compute_outputs, make_trainable, train_step

    model = ModelConfig(num_layers=30, hidden_size=576, ffn_hidden_size=1536,
                        num_attention_heads=9, num_kv_heads=3, vocab_size=49152,
                        max_position_embeddings=2048, tie_embeddings=True)
    config = JobConfig(model=model, optimizer=OptimizerConfig(lr=1e-5))
    place = initialize(config).training
    trainable = make_trainable(build_gpt_model(model, config.parallel, place=place),
                               config.optimizer, "fp32")
    batch = rl_batch(args.rows, model.vocab_size)
    sides = {"every position": batch, "responses only": dict(batch,
                                                             output_mask=batch["loss_mask"])}
    positions = {"every position": int(batch["attention_mask"].sum()),
                 "responses only": int(batch["loss_mask"].sum())}
    best = {name: float("inf") for name in sides}
    for _ in range(args.rounds):
        for name, rows in sides.items():
            start = time.perf_counter()
            compute_outputs(trainable.chunks, rows, 2, "lm", model.vocab_size,
                            max_tokens=BUDGET)
            train_step(trainable, rows, 2, sft_loss, "lm", model.vocab_size,
                       max_tokens=BUDGET)
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"{args.rows} rows, {positions['every position']} tokens, "
          f"{positions['responses only']} of them response tokens; budget {BUDGET} tokens, "
          f"packed")
    print(f"{'output layer over':<18}{'positions':>10}{'seconds':>9}{'speed-up':>10}")
    for name in sides:
        print(f"{name:<18}{positions[name]:>10}{best[name]:>9.2f}"
              f"{best['every position'] / best[name]:>9.2f}x")
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16)
    run_world(1, _rank, parser.parse_args())


if __name__ == "__main__":
    main()
