"""Environments and tools the agents tests run in the sandbox (importable there by name)."""

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
