"""The agents example's files: the word tokenizer with its chat template, the questions of
"max behind a lookup" (mcore_rl.quickstart.hidden_max) and the demonstrations SFT warms up on.

    <dir>/data/    rl_train.jsonl, rl_val.jsonl (held out), sft_train.jsonl (one row per
                   assistant turn of the demonstrated episodes), sft_val.jsonl
    <dir>/hf_init/ the tiny random Llama and its tokenizer (HF)
"""

from __future__ import annotations

import random
from pathlib import Path

from mcore_rl.data.toy import DIGITS, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN, write_word_tokenizer

from .hidden_max import KEYS
from .task import episode_sft_rows, write_jsonl
from .tiny_model import write_tiny_llama

DATA_SOURCE = "toy/max"
ROLES = ("user", "assistant", "tool")
VOCABULARY = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, "max", "call", "lookup", "error") + DIGITS \
    + ROLES + KEYS
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")
"""Each message as "<role> <content> <eos>", then "assistant" where the model answers."""
TRAIN_QUESTIONS, HELD_OUT_QUESTIONS, DEMONSTRATIONS, SEED = 2000, 200, 16, 0


def write_tokenizer(folder: str) -> str:
    """The word-level tokenizer with the chat template, as an HF folder."""
    return write_word_tokenizer(folder, VOCABULARY, chat_template=CHAT_TEMPLATE)


def questions(count: int, seed: int) -> list[dict]:
    """`count` questions: two distinct keys, a random table, the larger of their digits."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        first, second = rng.sample(KEYS, 2)
        table = {key: rng.choice(DIGITS) for key in KEYS}
        rows.append({"prompt": [{"role": "user", "content": f"max {first} {second}"}],
                     "data_source": DATA_SOURCE,
                     "reward_model": {"style": "rule",
                                      "ground_truth": max(table[first], table[second])},
                     "extra_info": {"table": table, "keys": [first, second]}})
    return rows


def demonstration(row: dict) -> list[dict]:
    """The episode that solves `row` with two lookups."""
    first, second = row["extra_info"]["keys"]
    table = row["extra_info"]["table"]
    return [*row["prompt"],
            {"role": "assistant", "content": f"call lookup {first}"},
            {"role": "tool", "content": table[first]},
            {"role": "assistant", "content": f"call lookup {second}"},
            {"role": "tool", "content": table[second]},
            {"role": "assistant", "content": row["reward_model"]["ground_truth"]}]


def sft_rows(rows: list[dict]) -> list[dict]:
    """One SFT row per assistant turn of each row's demonstration."""
    return [sft_row for row in rows for sft_row in episode_sft_rows(demonstration(row))]


def prepare(directory: str) -> None:
    """The example's data and tiny random HF model (kept when already there):
    <dir>/data/rl_train.jsonl, rl_val.jsonl (held out), sft_train.jsonl (one row per turn of
    the demonstrations), sft_val.jsonl; <dir>/hf_init."""
    root = Path(directory)
    if (root / "hf_init").is_dir():
        print(f"prepare: {root / 'hf_init'} exists, keeping it and {root / 'data'}")
        return
    rows = questions(TRAIN_QUESTIONS + HELD_OUT_QUESTIONS, SEED)
    train, held_out = rows[:TRAIN_QUESTIONS], rows[TRAIN_QUESTIONS:]
    data = root / "data"
    write_jsonl(str(data / "rl_train.jsonl"), train)
    write_jsonl(str(data / "rl_val.jsonl"), held_out)
    write_jsonl(str(data / "sft_train.jsonl"), sft_rows(train[:DEMONSTRATIONS]))
    write_jsonl(str(data / "sft_val.jsonl"), sft_rows(held_out[:DEMONSTRATIONS]))
    write_tiny_llama(str(root / "hf_init"), VOCABULARY, SEED, chat_template=CHAT_TEMPLATE)
    print(f"prepare: {DEMONSTRATIONS} demonstrations, {len(train)} training and "
          f"{len(held_out)} held-out questions in {data}; tiny Llama in {root / 'hf_init'}")
