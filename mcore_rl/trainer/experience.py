"""A step's experience: generations and their scores as the [n, s] tensors the roles consume.

Rows are prompt+response sequences, right-padded. `response_mask` marks response tokens;
`loss_mask` is the subset that trains (overlong filtering removes truncated responses from it);
the outcome reward sits on each response's last token of `token_rewards`. `group_ids` name the
prompt a row answers (whole groups stay on one rank, as GRPO-style estimators need).
"""

from __future__ import annotations

import torch

from mcore_rl.config.rl import RolloutConfig
from mcore_rl.rollout import Generation


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025): 0 up to max - buffer tokens, then
    falling linearly to -1 at max_new_tokens."""
    excess = (lengths - (max_new_tokens - buffer)).clamp(min=0).float()
    return -(excess / buffer).clamp(max=1.0)


def make_experience(generation: Generation, scores: list[float], rollout: RolloutConfig,
                    pad_id: int) -> dict[str, torch.Tensor]:
    """Tensors for the update: input_ids, attention_mask, response_mask, loss_mask,
    engine_logprobs, token_rewards [n, s]; scores, group_ids, truncated [n]."""
    batch = generation.response_tensors(pad_id)
    completions = generation.completions
    response_mask = batch["response_mask"]
    lengths = response_mask.sum(dim=1)
    truncated = torch.tensor([c.finish_reason == "length" for c in completions])
    scores = torch.tensor(scores, dtype=torch.float32)
    if rollout.overlong == "penalty":
        scores = scores + overlong_penalty(lengths, rollout.sampling.max_new_tokens,
                                           rollout.overlong_buffer)
    loss_mask = response_mask.clone()
    if rollout.overlong == "filter":
        loss_mask[truncated] = 0
    token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = batch["attention_mask"].sum(dim=1) - 1
    has_response = lengths > 0
    rows = torch.arange(len(completions))[has_response]
    token_rewards[rows, last[has_response]] = scores[has_response]
    batch.update(loss_mask=loss_mask, token_rewards=token_rewards, scores=scores,
                 group_ids=torch.tensor([c.prompt_index for c in completions]),
                 truncated=truncated)
    return batch


def mini_batches(batch: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """`count` consecutive equal slices of the rows (the config guarantees they divide)."""
    rows = batch["input_ids"].shape[0]
    size = rows // count
    return [{name: tensor[start:start + size] for name, tensor in batch.items()}
            for start in range(0, rows, size)]
