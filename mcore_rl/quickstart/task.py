"""The quickstart's task: "max 3 8 1" -> "8", the largest of three digits.

It is small enough for a CPU and still shows why RL follows SFT. Demonstrations are scarce
(24 of them), prompts with a checkable answer are plentiful (1000 distinct questions): a tiny
model fine-tuned on the 24 memorises them and answers only about half of the unseen questions;
GRPO on unlabelled prompts, rewarded by checking the answer, then generalises the rule. The
files are in verl's layouts (RL: prompt, data_source, reward_model.ground_truth; SFT: prompt,
response), the same a user brings.
"""

from __future__ import annotations

import json

import numpy as np

from mcore_rl.data.toy import DIGITS, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN
from mcore_rl.runtime.files import write_text_atomically

DATA_SOURCE = "toy/max"
VOCABULARY = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, "max") + DIGITS
DIGITS_PER_QUESTION = 3


def split_questions(held_out: int, demonstrations: int, seed: int
                    ) -> dict[str, list[tuple[str, str]]]:
    """All 1000 questions as (prompt, answer) pairs such as ("max 3 8 1", "8"), split in a
    seeded order: `held_out` for evaluation only, and the rest for training, of which the
    first `demonstrations` also get a demonstration."""
    triples = np.array(np.meshgrid(*[range(10)] * DIGITS_PER_QUESTION, indexing="ij"))
    triples = triples.reshape(DIGITS_PER_QUESTION, -1).T
    order = np.random.default_rng(seed).permutation(len(triples))
    pairs = [("max " + " ".join(str(d) for d in row), str(max(row)))
             for row in triples[order].tolist()]
    train = pairs[held_out:]
    return {"held_out": pairs[:held_out], "train": train, "demonstrations": train[:demonstrations]}


def rl_rows(pairs: list[tuple[str, str]]) -> list[dict]:
    """Prompt rows for `mcore-rl train` (the answer only as the reward's ground truth)."""
    return [{"prompt": prompt, "data_source": DATA_SOURCE,
             "reward_model": {"style": "rule", "ground_truth": answer}}
            for prompt, answer in pairs]


def sft_rows(pairs: list[tuple[str, str]]) -> list[dict]:
    """Demonstration rows for `mcore-rl sft`."""
    return [{"prompt": prompt, "response": answer} for prompt, answer in pairs]


def episode_sft_rows(messages: list[dict]) -> list[dict]:
    """One `mcore-rl sft` row per assistant turn of a demonstrated episode: the conversation
    before it as the prompt, the turn as the response (its prompt + response + end of sequence
    is a prefix of the episode's tokens, so SFT trains exactly the tokens RL marks, each in its
    context)."""
    return [{"prompt": messages[:turn], "response": message["content"]}
            for turn, message in enumerate(messages) if message["role"] == "assistant"]


def preference_rows(pairs: list[tuple[str, str]]) -> list[dict]:
    """Preference rows for `mcore-rl rm` and `mcore-rl dpo`: each question's answer chosen over
    every one of the nine wrong digits. A reward model that PPO maximises must rank the answer
    above all of them, and one wrong digit per question does not teach that: such a model
    ranked 87-97.5% of pairs right while its highest-scored answer was right on only
    38.5-85% of held-out questions (docs/preference.md); always rejecting the smallest digit
    taught it "larger is better"."""
    return [{"prompt": prompt, "chosen": answer, "rejected": digit}
            for prompt, answer in pairs for digit in DIGITS if digit != answer]


def write_jsonl(path: str, rows: list[dict]) -> str:
    """Write `rows` as JSON lines (to a temporary name, then renamed)."""
    return write_text_atomically(path, "".join(json.dumps(row) + "\n" for row in rows))
