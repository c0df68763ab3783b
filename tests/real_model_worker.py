"""Ranks of the SmolLM2 world: logits and greedy generations at TP3 and TP1 (DP3)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from conversion_worker import _set_layout, megatron_logits
from mcore_rl.checkpoint.weights_io import read_metadata
from mcore_rl.config import InitConfig, ParallelConfig
from mcore_rl.models import build_gpt_model
from mcore_rl.models.pretrained import load_initial_weights


def greedy(module, prompt: torch.Tensor, new_tokens: int, vocab_size: int) -> list[int]:
    """Greedy decoding by full forward passes (no cache: a reference, not an engine)."""
    tokens = prompt.clone()
    for _ in range(new_tokens):
        logits = megatron_logits(module, tokens.unsqueeze(0), vocab_size)
        tokens = torch.cat([tokens, logits[0, -1].argmax().view(1)])
    return tokens[len(prompt):].tolist()


def run_real_model(ckpt: str, prompt: torch.Tensor, new_tokens: int, out_path: str) -> None:
    from mcore_rl.runtime import start_process_group

    start_process_group(timeout_minutes=5)
    model = read_metadata(ckpt)["model"]
    results = {}
    for tp in (3, 1):
        place = _set_layout(tp, 1)
        module = build_gpt_model(model, ParallelConfig(tensor_model_parallel_size=tp),
                                 place=place).eval()
        load_initial_weights(module, InitConfig(checkpoint=ckpt), model)
        results[tp] = {"logits": megatron_logits(module, prompt.unsqueeze(0), model.vocab_size),
                       "greedy": greedy(module, prompt, new_tokens, model.vocab_size)}
    if dist.get_rank() == 0:
        torch.save(results, out_path)
