"""The toy copy task: "copy 7" -> "7", with a word-level tokenizer of 16 tokens.

CPU tests need an RL task that a tiny random-init model learns in a few dozen steps and a reward
that is exact. Copying the last prompt token is such a task: the answer is one token, every
prompt ends with it, and the tokenizer is a plain HF tokenizer folder
(`AutoTokenizer.from_pretrained` loads it) so the trainer needs no special path for it.
"""

from __future__ import annotations

import os

import numpy as np

from .records import PromptRecord

PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<eos>", "<unk>"
DIGITS = tuple(str(digit) for digit in range(10))
# Token id = position: <pad>=0, <eos>=1, copy=2, digits "0".."9" = 3..12, then the rest.
TOY_VOCAB = (PAD_TOKEN, EOS_TOKEN, "copy") + DIGITS + (UNK_TOKEN, "answer", "is")
TOY_VOCAB_SIZE = len(TOY_VOCAB)
TOY_DATA_SOURCE = "toy/copy"
TOY_MAX_LENGTH = 64


def write_toy_tokenizer(folder: str) -> str:
    """Write tokenizer.json and tokenizer_config.json of the toy vocabulary into `folder`
    (created if needed); returns `folder`."""
    return write_word_tokenizer(folder, TOY_VOCAB)


def write_word_tokenizer(folder: str, vocabulary: tuple[str, ...],
                         max_length: int = TOY_MAX_LENGTH, chat_template: str | None = None
                         ) -> str:
    """A whitespace word-level HF tokenizer (token id = position in `vocabulary`, which must
    start with PAD_TOKEN, EOS_TOKEN and contain UNK_TOKEN), with `chat_template` if given,
    written into `folder`."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: token_id for token_id, token in enumerate(vocabulary)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN, model_max_length=max_length)
    fast.chat_template = chat_template
    os.makedirs(folder, exist_ok=True)
    fast.save_pretrained(folder)
    return folder


def toy_copy_records(count: int, seed: int, start_index: int = 0) -> list[PromptRecord]:
    """`count` prompts "copy D" (D a seeded random digit, the prompt's last token) whose
    ground truth is "D"."""
    digits = np.random.default_rng(seed).integers(0, 10, size=count)
    return [PromptRecord(index=start_index + position, prompt=f"copy {digit}",
                         data_source=TOY_DATA_SOURCE, ground_truth=str(digit), extra_info={})
            for position, digit in enumerate(digits.tolist())]
