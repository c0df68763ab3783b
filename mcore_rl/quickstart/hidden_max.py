"""The agents example: "max g j" -> look both keys up with a tool, answer the larger digit.

The quickstart's `max` skill with the digits hidden: every question has its own random table
key -> digit, which only the `lookup` tool reads (the model never sees it otherwise), so no
model can beat guessing without the tool: the best tool-free answer, "9", is right 19% of the
time (1 - 0.9^2). An episode:

    user       max g j
    assistant  call lookup g <eos>
    tool       7 <eos>
    assistant  call lookup j <eos>
    tool       3 <eos>
    assistant  7 <eos>

The tokenizer is word-level with a ChatML-like word template (every word a token, the turn
ended by <eos>), and tool calls are the words "call <tool> <argument>" (parse_word_calls): the
tiny model would need a dozen tokens of JSON punctuation per call in the Hermes format.

This module is what the episodes' sandboxed processes import, so it imports nothing heavy (no
torch); the example's data and model are made by agents_example.py.
"""

from __future__ import annotations

from mcore_rl.agents.environment import Environment
from mcore_rl.agents.tool_calls import ToolCall, ToolCallError

KEYS = tuple("abcdefghij")


class HiddenMax(Environment):
    """The row's table behind a lookup tool; the episode ends with an answer that calls no
    tool (scored by toy/max's reward on the final message)."""

    def reset(self, row):
        self.table = row["extra_info"]["table"]

    def lookup(self, key: str) -> str:
        """The digit stored under a key.

        Args:
            key: A letter from a to j.
        """
        return self.table[key]


def parse_word_calls(text: str) -> list[ToolCall]:
    """"call lookup g" -> [ToolCall("lookup", {"key": "g"})]; text without "call" -> []."""
    words = text.split()
    if "call" not in words:
        return []
    if len(words) != 3 or words[0] != "call":
        raise ToolCallError(f"a call is 'call <tool> <key>', not {text!r}")
    return [ToolCall(words[1], {"key": words[2]})]
