"""Environments and tools the agents tests run in the sandbox (importable there by name)."""

import time

from mcore_rl.agents import Environment

TABLE = {"a": "7", "b": "3", "c": "4"}


class Lookup(Environment):
    """A fixed table behind a lookup tool, plus tools that misbehave."""

    def reset(self, row):
        self.looked_up = []

    def lookup(self, key: str) -> str:
        """The value stored under a key.

        Args:
            key: The key.
        """
        self.looked_up.append(key)
        return TABLE[key]

    def spin(self, seconds: int) -> str:
        """Busy for a while.

        Args:
            seconds: How long.
        """
        while True:
            pass

    def get_reward(self, messages):
        return float(len(self.looked_up))


class Undocumented(Environment):
    """A tool without a docstring: refused before any rollout."""

    def lookup(self, key: str) -> str:
        return key


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


class Broken(Environment):
    """An environment that cannot be made."""

    def __init__(self):
        raise RuntimeError("no table today")


class Countdown(Environment):
    """Answers every model turn with the turns left until the third, whatever the model wrote:
    multi-turn episodes even from a random model."""

    def reset(self, row):
        self.turns = 0

    def step(self, assistant_message):
        self.turns += 1
        return None if self.turns == 3 else [{"role": "tool", "content": str(3 - self.turns)}]


class SlowFirstPrompt(Lookup):
    """Lookup whose first step takes a while on prompts that ask for it ("slow ...")."""

    def reset(self, row):
        super().reset(row)
        self.slow = row["prompt"][0]["content"].startswith("slow")

    def step(self, assistant_message):
        if self.slow and not self.looked_up:
            time.sleep(0.5)
        return super().step(assistant_message)
