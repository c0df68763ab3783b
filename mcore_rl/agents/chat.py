"""The token contract of an episode: the tokens trained are the tokens the engine sampled, and
every other token is what the chat template renders around them.

The peers' most reported multi-turn bug is one bug: the trained tokens are not the sampled ones
(decoded text encoded again: BPE is not a bijection), or a separator the template puts after
the end-of-turn token is lost at every assistant -> tool boundary. Here the model's turns enter
the episode only as the engine's token ids, and an observation is tokenised as the template's
own delta ("rule B"):

    seen  = render(messages before the model's turn, generation prompt)   # what the model was fed
    after = render(those + the model's turn + the observations, generation prompt)
    observation ids = encode(after minus (seen + decode(sampled ids)))

The model's turn is never rendered as the conversation's last message (templates treat the last
assistant message specially, e.g. Qwen3's empty think block), and the template's separator after
the end-of-turn token is the first observation token. Where `after` does not start with
`seen + decode(sampled ids)`, the template is not prefix-preserving at that turn (one that drops
earlier reasoning, say): TemplateMismatch names the turn and the first differing characters.
"""

from __future__ import annotations

import os


class TemplateMismatch(ValueError):
    """The chat template renders an earlier part of the conversation differently once more
    messages follow, so the episode's tokens cannot equal the template's."""


class ChatFormat:
    """A tokenizer's chat template with the episode's tools: prompt ids, observation ids and
    the token that ends an assistant turn."""

    def __init__(self, tokenizer, tools: list[dict] | None = None,
                 template_kwargs: dict | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"multi-turn rollouts need a chat template; the tokenizer "
                             f"{getattr(tokenizer, 'name_or_path', tokenizer)!r} has none")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template_kwargs = template_kwargs or {}
        self.end_of_turn_id = self._end_of_turn_id()
        """The token the template writes right after an assistant message's content (the model
        must sample it to end its turn)."""

    def render(self, messages: list[dict], generation_prompt: bool = True) -> str:
        """The template's text for `messages` (with the tools), ending with the assistant's
        generation prompt unless `generation_prompt` is false."""
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt,
            **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (its special tokens included as text)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        """Text of token ids as the template would have written them (special tokens kept)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """What the model is fed before its first turn."""
        return self.encode(self.render(messages))

    def assistant_message(self, sampled_ids: list[int]) -> dict:
        """The model's turn as a message: its sampled text without the end-of-turn token (the
        raw text, tool calls included as the model wrote them: a structured tool_calls field
        would render differently from what was sampled)."""
        content = sampled_ids[:-1] if sampled_ids[-1:] == [self.end_of_turn_id] else sampled_ids
        return {"role": "assistant",
                "content": self.tokenizer.decode(content, skip_special_tokens=False)}

    def observation_ids(self, history: list[dict], sampled_ids: list[int],
                        observations: list[dict], turn: int) -> list[int]:
        """Tokens between the model's turn (`sampled_ids`, answering `history`) and its next
        turn: the template's separator, the observation messages, the next generation prompt."""
        seen = self.render(history)
        sampled_text = self.decode(sampled_ids)
        after = self.render(history + [self.assistant_message(sampled_ids)] + observations)
        if after.startswith(seen + sampled_text):
            return self.encode(after[len(seen) + len(sampled_text):])
        # Text that differs only where the tokenizer does not look (the spaces a word-level
        # tokenizer drops around an empty turn) still continues the exact ids.
        fed = self.encode(seen) + list(sampled_ids)
        whole = self.encode(after)
        if whole[:len(fed)] == fed:
            return whole[len(fed):]
        expected = seen + sampled_text
        where = len(os.path.commonprefix([after, expected]))
        raise TemplateMismatch(
            f"turn {turn}: the chat template renders the conversation so far differently "
            f"once the observation follows, from character {where}: "
            f"{expected[where:where + 40]!r} became {after[where:where + 40]!r}")

    def check_prefix_preserving(self) -> None:
        """Run a probe conversation (a question, an answer, a tool result) through the token
        contract; TemplateMismatch when the template cannot keep it."""
        history = [{"role": "user", "content": "What is 6 times 7?"}]
        answer = self.encode("Let me compute it.") + [self.end_of_turn_id]
        try:
            self.observation_ids(history, answer, [{"role": "tool", "content": "42"}], 1)
        except TemplateMismatch as mismatch:
            raise TemplateMismatch(
                f"the chat template is not prefix-preserving (with template_kwargs="
                f"{self.template_kwargs}): {mismatch}; rollout.multi_turn.template_mismatch="
                "end runs it anyway, ending each episode where it differs") from None

    def truncate(self, message: dict, max_tokens: int) -> tuple[dict, bool]:
        """The message with its content cut to `max_tokens` tokens, and whether it was cut."""
        ids = self.encode(message.get("content") or "")
        if len(ids) <= max_tokens:
            return message, False
        return {**message, "content": self.tokenizer.decode(ids[:max_tokens])}, True

    def _end_of_turn_id(self) -> int:
        marker = "MCORE_RL_TURN"
        text = self.render([{"role": "user", "content": "u"},
                            {"role": "assistant", "content": marker}], generation_prompt=False)
        tail = text[text.rindex(marker) + len(marker):]
        ids = self.encode(tail)
        special = set(self.tokenizer.all_special_ids)
        if not ids or ids[0] not in special:
            raise ValueError(f"the chat template ends an assistant message with {tail[:20]!r}, "
                             "not with a special token the model can sample to end its turn")
        return ids[0]
