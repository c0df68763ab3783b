"""The memory cuts of docs/training.md ("Memory on the TRL bench") change no number the job
computes: log-probs, entropy and their gradients do not depend on the chunk size, and equal the
unchunked computation; the CPU engine's KV cache is sized for the sequences the job runs."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

from mcore_rl.config.model import ModelConfig
from mcore_rl.models.logprobs import CHUNK_TOKENS, vocab_parallel_logprobs_and_entropy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _case(tokens=300, width=96, vocab=90, seed=0):
    """fp32 logits [2, tokens/2, width] (columns from `vocab` on are TP padding) and targets."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, tokens // 2, width, generator=generator) * 4
    targets = torch.randint(0, vocab, (2, tokens // 2), generator=generator)
    grad_logprobs = torch.randn(2, tokens // 2, generator=generator)
    grad_entropy = torch.randn(2, tokens // 2, generator=generator)
    return logits, targets, grad_logprobs, grad_entropy


def _run(logits, targets, grads, vocab, temperature, chunk_tokens):
    leaf = logits.clone().requires_grad_(True)
    logprobs, entropy = vocab_parallel_logprobs_and_entropy(
        leaf, targets, vocab, temperature=temperature, chunk_tokens=chunk_tokens)
    torch.autograd.backward([logprobs, entropy], list(grads))
    return logprobs.detach(), entropy.detach(), leaf.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_do_not_depend_on_the_chunk_size(temperature):
    """Bitwise: every position is computed alone, so a chunk of 1, 7, the default or all
    positions gives the same log-probs, entropy and gradients (the default's cut from 1024
    changes no number)."""
    logits, targets, *grads = _case()
    vocab = 90
    results = [_run(logits, targets, grads, vocab, temperature, chunk)
               for chunk in (1, 7, CHUNK_TOKENS, 1024, 10 ** 6)]
    for result in results[1:]:
        for got, want in zip(result, results[0]):
            assert torch.equal(got, want)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_the_unchunked_computation(temperature):
    """Against autograd through log_softmax over the real columns (what an unchunked
    implementation keeps whole): values and gradients within 1e-6 (relative or absolute: fp32
    rounding of log-probs near -20); padding columns get no
    gradient."""
    logits, targets, *grads = _case()
    vocab = 90
    logprobs, entropy, grad = _run(logits, targets, grads, vocab, temperature, 7)

    leaf = logits.clone().requires_grad_(True)
    logp_all = torch.log_softmax(leaf[..., :vocab] / temperature, dim=-1)
    want_logprobs = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want_entropy = -(logp_all.exp() * logp_all).sum(-1)
    torch.autograd.backward([want_logprobs, want_entropy], grads)
    torch.testing.assert_close(logprobs, want_logprobs.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-6, atol=1e-6)
    assert not grad[..., vocab:].any()


SMOLLM2 = ModelConfig(num_layers=30, hidden_size=576, ffn_hidden_size=1536,
                      num_attention_heads=9, num_kv_heads=3, vocab_size=49152)


def test_cpu_kv_cache_holds_the_sequences_the_job_runs():
    """SmolLM2 in fp32, context 256: 16 running sequences take 16 x 256 tokens x 2 (K, V) x 30
    layers x 3 heads x 64 x 4 bytes (0.18 GiB); vLLM's CPU default of 256 took 2.8 GiB. The
    engine arguments carry max_num_seqs only when it is given."""
    from mcore_rl.rollout.vllm_start import _cpu_kv_cache_args, _cpu_kv_cache_bytes

    if torch.cuda.is_available():
        pytest.skip("the CPU engine's sizing")
    per_token = 2 * 30 * 3 * 64 * 4
    assert _cpu_kv_cache_bytes(SMOLLM2, 1, 256, torch.float32, 0.4, 16) == 16 * 256 * per_token
    assert _cpu_kv_cache_bytes(SMOLLM2, 1, 256, torch.float32, 0.4) == \
        min(256 * 256 * per_token, _cpu_kv_cache_bytes(SMOLLM2, 1, 256, torch.float32, 0.4))
    assert _cpu_kv_cache_args(SMOLLM2, 1, 256, torch.float32, 0.4, 16) == {
        "kv_cache_memory_bytes": 16 * 256 * per_token, "max_num_seqs": 16}
    assert "max_num_seqs" not in _cpu_kv_cache_args(SMOLLM2, 1, 256, torch.float32, 0.4)


def test_engine_runs_a_step_of_sequences_per_instance(monkeypatch):
    """Colocated: an instance's part of prompts_per_step, times n; split placement keeps vLLM's
    default (several batches in flight)."""
    from mcore_rl.config.job import JobConfig
    from mcore_rl.config.placement import PlacementConfig
    from mcore_rl.rl import build

    config = JobConfig()
    rollout = dataclasses.replace(config.rollout, prompts_per_step=2, rollout_tp=1,
                                  sampling=dataclasses.replace(config.rollout.sampling, n=8))
    config = dataclasses.replace(config, rollout=rollout)
    monkeypatch.setattr(build.dist, "get_world_size", lambda *_: 1)
    assert build._running_sequences(config) == 16
    monkeypatch.setattr(build.dist, "get_world_size", lambda *_: 4)
    assert build._running_sequences(config) == 8  # 4 instances of 1 rank: 1 prompt x 8 each
    split = dataclasses.replace(config, placement=PlacementConfig(rollout_ranks=2))
    assert build._running_sequences(split) is None


def test_trl_side_reports_its_peak_with_its_children():
    """bench/trl_side.py's peak: its own ru_maxrss plus its children's largest, in MB."""
    spec = importlib.util.spec_from_file_location(
        "trl_side", os.path.join(REPO, "bench", "trl_side.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    peak = module.peak_resident_mb()
    assert peak["self_mb"] > 10 and peak["children_mb"] >= 0
    assert peak["peak_mb"] == peak["self_mb"] + peak["children_mb"]
