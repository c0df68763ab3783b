"""Vocab-parallel log-probs and entropy equal log_softmax on the gathered logits, values and
gradients, at TP 1, 2 and 4 with a vocabulary padded for TP, over the whole batch in one chunk
and in chunks of positions that do not divide it (the backward recomputes each chunk)."""

import pytest
import torch
import torch.distributed as dist

from mcore_rl.models.logprobs import vocab_parallel_logprobs_and_entropy
from device_discipline import HostSynchronisations
from world import run_world

VOCAB, PADDED = 250, 256
CHUNKS = (1024, 4)
"""Positions per chunk: all 21 at once, and chunks of 4 (the last one of 1)."""


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
    want_logp, want_entropy, want_grad = loss_and_grad(reference, logits, targets, weights)
    for chunk_tokens in CHUNKS:
        logp, entropy, grad = loss_and_grad(
            lambda x, t: vocab_parallel_logprobs_and_entropy(
                x, t, VOCAB, dist.group.WORLD, chunk_tokens=chunk_tokens),
            local, targets, weights)
        assert (logp - want_logp).abs().max() < 1e-5
        assert (entropy - want_entropy).abs().max() < 1e-5
        assert (grad - want_grad.chunk(world_size, dim=-1)[rank]).abs().max() < 1e-5
    if world_size == 2:  # the finite-gradient check: one wait per step, not one per parameter
        assert _finite_check_synchronisations(parameters=50) == (True, 1, False, 1)


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_single_rank_matches_log_softmax(chunk_tokens, temperature):
    logits, targets, weights = inputs()
    got = loss_and_grad(lambda x, t: vocab_parallel_logprobs_and_entropy(
        x, t, VOCAB, temperature=temperature, chunk_tokens=chunk_tokens),
        logits, targets, weights)
    want = loss_and_grad(lambda x, t: reference(x / temperature, t), logits, targets, weights)
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-5
    assert got[2][..., VOCAB:].abs().max() == 0, "padding columns received gradient"


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_matches_log_softmax(world_size):
    """Also, at TP2 (the ranks all-reduce its verdict): the optimizer step's finite-gradient
    check waits for the device once, not once per parameter (thousands of stalls per step for
    an MoE model)."""
    run_world(world_size, _check_tp, world_size)


def test_log_probs_and_their_gradient_never_wait_for_the_device():
    logits, targets, weights = inputs()
    with HostSynchronisations() as synchronisations:
        loss_and_grad(lambda x, t: vocab_parallel_logprobs_and_entropy(
            x, t, VOCAB, chunk_tokens=4), logits, targets, weights)
    assert synchronisations.count == 0


def _finite_check_synchronisations(parameters: int) -> tuple[bool, int, bool, int]:
    from mcore_rl.training.forward_backward import _gradients_finite

    chunk = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(3)) for _ in range(parameters)])
    for parameter in chunk:
        parameter.main_grad = torch.ones(3)
    with HostSynchronisations() as finite_pass:
        finite = _gradients_finite([chunk])
    chunk[-1].main_grad[1] = float("nan")
    with HostSynchronisations() as nan_pass:
        nan_finite = _gradients_finite([chunk])
    return finite, finite_pass.count, nan_finite, nan_pass.count
