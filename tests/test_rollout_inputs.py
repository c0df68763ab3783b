"""Sampling parameters and prompts are checked before any generation starts."""

import dataclasses

import pytest

from mcore_rl.config.rollout import PromptConfig, SamplingConfig
from mcore_rl.rollout import PromptError, prepare_prompts


def test_default_sampling_is_valid():
    assert SamplingConfig().errors() == []
    assert SamplingConfig(temperature=0.0, top_p=1.0, top_k=5).errors() == []


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -0.1, "sampling.temperature=-0.1 must be >= 0"),
    ("top_p", 0.0, "sampling.top_p=0.0 must be in (0, 1]"),
    ("top_p", 1.5, "sampling.top_p=1.5 must be in (0, 1]"),
    ("top_k", 0, "sampling.top_k=0 must be -1 (all tokens) or positive"),
    ("n", 0, "sampling.n=0 must be at least 1"),
    ("max_new_tokens", 0, "sampling.max_new_tokens=0 must be at least 1"),
    ("stop_token_ids", (2, -1), "sampling.stop_token_ids=[2, -1]"),
    ("stop", ("",), "sampling.stop must not contain empty strings"),
])
def test_out_of_range_sampling_is_named(field, value, message):
    errors = dataclasses.replace(SamplingConfig(), **{field: value}).errors()
    assert len(errors) == 1 and errors[0].startswith(message)


PROMPTS = [[1, 2, 3], list(range(10, 20)), [4, 5, 6, 7, 8]]


@pytest.mark.parametrize("side", ["left", "right"])
def test_overlong_prompts_are_truncated_on_the_configured_side(side):
    prepared = prepare_prompts(PROMPTS, PromptConfig(max_prompt_tokens=4, overlong=side), 100)
    keep = (lambda ids: ids[len(ids) - 4:]) if side == "left" else (lambda ids: ids[:4])
    assert prepared.token_ids == [ids if len(ids) <= 4 else keep(ids) for ids in PROMPTS]
    assert prepared.truncated == 2


def test_overlong_prompts_are_refused_with_index_and_length():
    with pytest.raises(PromptError) as error:
        prepare_prompts(PROMPTS, PromptConfig(max_prompt_tokens=4), 100)
    message = str(error.value)
    assert "prompt 1 has 10 tokens, more than max_prompt_tokens=4" in message
    assert "prompt 2 has 5 tokens" in message and "prompt 0" not in message


def test_empty_and_out_of_vocabulary_prompts_are_refused():
    with pytest.raises(PromptError, match=r"prompt 1 is empty; prompt 2 has token ids outside "
                                          r"\[0, 100\): \[100, -3\]"):
        prepare_prompts([[1], [], [100, 5, -3]], PromptConfig(), 100)
    with pytest.raises(PromptError, match="no prompts"):
        prepare_prompts([], PromptConfig(), 100)

