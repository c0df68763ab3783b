"""The sampler and the mismatch metrics against references: vLLM's own top-k/top-p function,
slow obvious implementations of the definitions, and empirical sampling frequencies."""

import importlib.util
import math

import pytest
import torch

from mcore_rl.config.rollout import PromptConfig, SamplingConfig
from mcore_rl.rollout import Completion, Generation, PromptError, check_request, logprob_mismatch
from mcore_rl.rollout.token_sampling import sample_next, truncate_logits


def slow_truncation(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Row by row: keep the top_k largest logits, then the most likely tokens (in descending
    order, ties by vLLM's ascending sort) until their probability first reaches top_p."""
    result = torch.full_like(logits, float("-inf"))
    for row in range(logits.shape[0]):
        values = logits[row]
        kept = list(range(len(values)))
        if top_k != -1:
            threshold = sorted(values.tolist())[len(values) - top_k]
            kept = [i for i in kept if values[i] >= threshold]
        if top_p < 1:
            probs = torch.softmax(values[kept], dim=0).tolist()
            order = sorted(range(len(kept)), key=lambda j: probs[j])  # ascending, like vLLM
            dropped_mass, dropped = 0.0, set()
            for j in order[:-1]:
                if dropped_mass + probs[j] > 1 - top_p + 1e-7:
                    break
                dropped_mass += probs[j]
                dropped.add(j)
            kept = [kept[j] for j in range(len(kept)) if j not in dropped]
        result[row, kept] = values[kept]
    return result


CASES = [(-1, 1.0), (5, 1.0), (-1, 0.9), (-1, 0.3), (7, 0.8), (1, 1.0), (-1, 1e-6)]


@pytest.mark.parametrize("top_k,top_p", CASES)
def test_truncation_matches_the_definition(top_k, top_p):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(top_k + 7))
    assert torch.equal(truncate_logits(logits, top_k, top_p).isinf(),
                       slow_truncation(logits, top_k, top_p).isinf())


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")
@pytest.mark.parametrize("top_k,top_p", CASES)
def test_truncation_matches_vllm(top_k, top_p):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(top_k + 11))
    k = None if top_k == -1 else torch.full((6,), top_k, dtype=torch.long)
    p = None if top_p == 1.0 else torch.full((6,), top_p)
    theirs = apply_top_k_top_p(logits.clone(), k, p)
    assert torch.equal(truncate_logits(logits, top_k, top_p), theirs)


def test_samples_follow_the_truncated_distribution_and_report_the_whole_one():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]])
    sampling = SamplingConfig(temperature=0.7, top_k=4, top_p=0.95)
    expected = torch.softmax(slow_truncation(logits / 0.7, 4, 0.95), dim=-1)[0]
    draws = 40000
    generator = torch.Generator().manual_seed(3)
    tokens, logprobs = sample_next(logits.expand(draws, -1), sampling, generator)
    frequencies = torch.bincount(tokens, minlength=6).double() / draws
    # Five standard errors of a binomial proportion.
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / draws) + 1e-9
    assert bool(((frequencies - expected).abs() <= tolerance).all()), (frequencies, expected)
    # Reported under the whole tempered distribution (what the trainer scores), not the kept
    # tokens' renormalised one.
    whole = torch.log_softmax(logits[0] / 0.7, dim=-1)
    assert torch.allclose(logprobs, whole[tokens], atol=1e-6)
    assert not torch.allclose(logprobs, expected.log()[tokens].float(), atol=1e-3)
    assert int(frequencies[4:].sum()) == 0  # outside top-k: never drawn


def test_greedy_takes_the_argmax_and_reports_the_models_logprob():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = sample_next(logits, SamplingConfig(temperature=0.0), torch.Generator())
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, logits.log_softmax(-1).max(-1).values)


def test_mismatch_metrics_follow_their_definitions():
    engine = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, 0.0]])
    trainer = torch.tensor([[-1.1, -2.0, -9.0], [-2.5, -0.1, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    deltas = [-0.1, 0.0, 0.5, 0.0]
    metrics = logprob_mismatch(engine, trainer, mask)
    assert metrics["rollout/logprob_abs_diff_max"] == pytest.approx(0.5)
    assert metrics["rollout/logprob_abs_diff_mean"] == pytest.approx(0.15)
    k3 = sum(math.exp(d) - 1 - d for d in deltas) / 4
    assert metrics["rollout/k3_kl"] == pytest.approx(k3)
    with pytest.raises(ValueError, match="selects no tokens"):
        logprob_mismatch(engine, trainer, torch.zeros_like(mask))


def test_requests_that_cannot_fit_or_repeat_greedy_are_refused():
    with pytest.raises(PromptError, match=r"max_prompt_tokens=100 \+ sampling.max_new_tokens=50 "
                                          r"= 150 exceeds the engine's context of 128"):
        check_request(SamplingConfig(max_new_tokens=50), PromptConfig(max_prompt_tokens=100), 128)
    with pytest.raises(PromptError, match="sampling.n=4 with temperature=0"):
        check_request(SamplingConfig(n=4, temperature=0.0), PromptConfig(max_prompt_tokens=8), 64)
    with pytest.raises(PromptError, match="prompts.overlong='middle' must be one of"):
        check_request(SamplingConfig(), PromptConfig(max_prompt_tokens=8, overlong="middle"), 512)


def test_response_tensors_align_logprobs_with_the_tokens_they_score():
    generation = Generation(
        completions=[Completion(0, 0, [7, 8], [-0.5, -0.25], "length"),
                     Completion(1, 0, [9], [-1.0], "stop")],
        prompts=[[1, 2, 3], [4]])
    batch = generation.response_tensors(pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 7, 8], [4, 9, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["response_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 1, 0, 0, 0]]
    assert batch["engine_logprobs"].tolist() == [[0, 0, 0, -0.5, -0.25], [0, -1.0, 0, 0, 0]]


def test_a_completion_without_routes_leaves_its_row_unrouted_and_the_others_routed():
    """One route-less row (an episode ended by a failed reset) must not drop the batch's
    routes: its row is NO_ROUTE (not replayed), the others keep theirs."""
    from mcore_rl.models.moe_routing import NO_ROUTE

    routes = torch.arange(3 * 2 * 2, dtype=torch.int16).reshape(3, 2, 2) % 4  # [fed, layers, k]
    generation = Generation(
        completions=[Completion(0, 0, [7, 8], [-0.5, -0.25], "length"),
                     Completion(0, 1, [9, 5, 6], [-1.0, -1.0, -1.0], "stop",
                                routed_experts=routes)],
        prompts=[[1]])
    given = generation.response_tensors(pad_id=0)["routed_experts"]
    assert given.shape == (2, 4, 2, 2)
    assert bool((given[0] == NO_ROUTE).all())
    assert torch.equal(given[1, :3], routes) and bool((given[1, 3:] == NO_ROUTE).all())

