"""Environments and tools the agents tests run in the sandbox (importable there by name), and
agents written against the OpenAI API that play the same game through the rank's endpoint."""

import json
import time

from mcore_rl.agents import Environment, tool_schemas

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


class TableFromFile(Environment):
    """Reads its table from the file the row names (a dataset an environment opens)."""

    def reset(self, row):
        with open(row["extra_info"]["table_file"]) as handle:
            self.table = json.load(handle)


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


class FlakyReset(Lookup):
    """Lookup whose reset fails on prompts that start with "broken" (a tool server down)."""

    def reset(self, row):
        if row["prompt"][0]["content"].startswith("broken"):
            raise ConnectionError("the table server is down")
        super().reset(row)


async def lookup_agent(row, base_url, edit_history=False):
    """Lookup's game as an OpenAI SDK agent: it offers Lookup's tools, runs each lookup itself
    and sends the results back, until an answer without tool calls; the reward is Lookup's
    (the number of lookups). edit_history: rewrite the question once the first result is in
    (a client that does not send its history back as it got it)."""
    from openai import AsyncOpenAI

    messages, looked_up = list(row["prompt"]), 0
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        while True:
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=tool_schemas(Lookup, {}))
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return float(looked_up)
            for call in message.tool_calls:
                value = TABLE[json.loads(call.function.arguments)["key"]]
                looked_up += 1
                messages.append({"role": "tool", "tool_call_id": call.id, "content": value})
            if edit_history and looked_up == 1:
                messages[0] = {**messages[0], "content": messages[0]["content"] + " Quickly."}


def counted_lookup():
    """Lookup's tool as a plain function for an agent library to wrap, and the count of its
    calls (a list of one)."""
    calls = [0]

    def lookup(key: str) -> str:
        """The value stored under a key.

        Args:
            key: The key.
        """
        calls[0] += 1
        return TABLE[key]

    return lookup, calls


async def openai_agents_lookup(row, base_url):
    """Lookup's game written with the openai-agents SDK, as its users write agents: a
    `function_tool`, an `Agent` on a Chat Completions model pointed at the rank's endpoint, and
    `Runner.run`, which calls the tool and sends its result back until an answer without tool
    calls. The reward is the number of lookups."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
    from agents import set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI
    lookup, calls = counted_lookup()
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    agent = Agent(name="lookup", tools=[function_tool(lookup)],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    await Runner.run(agent, row["prompt"], max_turns=10)
    return float(calls[0])


async def langchain_lookup(row, base_url):
    """Lookup's game written with LangChain, as its users write agents: a `tool`, a
    `ChatOpenAI` model pointed at the rank's endpoint and `create_agent`'s loop, which calls the
    tool and sends its result back until an answer without tool calls. The reward is the number
    of lookups."""
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    lookup, calls = counted_lookup()
    model = ChatOpenAI(model="policy", base_url=base_url, api_key="unused", max_retries=0)
    await create_agent(model, tools=[tool(lookup)]).ainvoke({"messages": row["prompt"]})
    return float(calls[0])


async def editing_agent(row, base_url):
    """lookup_agent rewriting its history after the first lookup."""
    return await lookup_agent(row, base_url, edit_history=True)


async def failing_agent(row, base_url):
    """An agent whose own code fails after one completion."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        await client.chat.completions.create(model="policy", messages=row["prompt"])
    raise RuntimeError("the agent's tool broke")
