"""Vocab-parallel log-probs and entropy equal log_softmax on the gathered logits, values and
gradients, at TP 1, 2 and 4 with a vocabulary padded for TP."""

import pytest
import torch
import torch.distributed as dist

from mcore_rl.models.logprobs import vocab_parallel_logprobs_and_entropy
from world import run_world

VOCAB, PADDED = 250, 256


def reference(logits, targets):
    """The obvious computation on full logits with padding columns removed."""
    real = logits[..., :VOCAB]
    log_probs = torch.log_softmax(real, dim=-1)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy


def inputs():
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(3, 7, PADDED, generator=generator)
    logits[..., VOCAB:] = 5.0  # padding rows must not count even when their logits are large
    targets = torch.randint(0, VOCAB, (3, 7), generator=generator)
    weights = torch.randn(2, 3, 7, generator=generator)
    return logits, targets, weights


def loss_and_grad(function, logits, targets, weights):
    logits = logits.clone().requires_grad_(True)
    logp, entropy = function(logits, targets)
    (weights[0] * logp + weights[1] * entropy).sum().backward()
    return logp.detach(), entropy.detach(), logits.grad


def _check_tp(world_size):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logits, targets, weights = inputs()
    local = logits.chunk(world_size, dim=-1)[rank]
    logp, entropy, grad = loss_and_grad(
        lambda x, t: vocab_parallel_logprobs_and_entropy(x, t, VOCAB, dist.group.WORLD),
        local, targets, weights)
    want_logp, want_entropy, want_grad = loss_and_grad(reference, logits, targets, weights)
    assert (logp - want_logp).abs().max() < 1e-5
    assert (entropy - want_entropy).abs().max() < 1e-5
    assert (grad - want_grad.chunk(world_size, dim=-1)[rank]).abs().max() < 1e-5


def test_single_rank_matches_log_softmax():
    logits, targets, weights = inputs()
    got = loss_and_grad(lambda x, t: vocab_parallel_logprobs_and_entropy(x, t, VOCAB),
                        logits, targets, weights)
    want = loss_and_grad(reference, logits, targets, weights)
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-5
    assert got[2][..., VOCAB:].abs().max() == 0, "padding columns received gradient"


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_matches_log_softmax(world_size):
    run_world(world_size, _check_tp, world_size)
