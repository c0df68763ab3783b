"""Agents written against the OpenAI API: through the rank's endpoint, the scripted conversation of
test_agents.py gives the very trajectory the Environment path gives (token ids, sampled mask,
log-probs, seeds), with the real FastAPI/uvicorn server, the real openai.AsyncOpenAI client on
loopback, and the real chat templates (SmolLM2's, and Qwen2.5's with tools on the stand-in
tokenizer); so do agents written with the openai-agents SDK (Agent, function_tool, Runner) and
with LangChain (ChatOpenAI, @tool, create_agent). A client that rewrites its history still
yields a valid trajectory (counted), and what the endpoint cannot honour is refused with HTTP
400.
"""

import asyncio
import copy
import dataclasses
import os
from types import SimpleNamespace

import httpx
import openai
import pytest
from agent_environments import (Lookup, editing_agent, failing_agent, langchain_lookup,
                                lookup_agent, openai_agents_lookup)
from test_agents import (QWEN_TOOL_TOKENS, SCRIPT, TEMPLATES, ScriptedEngine, record, runner_for,
                         sampled_turns)
from tokenizers import AddedToken
from transformers import AutoTokenizer

from mcore_rl.agents import AgentRunner, ChatFormat, tool_schemas
from mcore_rl.agents.openai_endpoint import MAX_BODY_BYTES
from mcore_rl.config import ConfigError, JobConfig
from mcore_rl.config.agents import MultiTurnConfig
from mcore_rl.config.rollout import SamplingConfig
from mcore_rl.conversion.gguf_to_hf import SMOLLM2_FILE, smollm2_gguf_path
from mcore_rl.rl.api import with_agent
from mcore_rl.rl.build import build_episode_runner

AGENT = MultiTurnConfig(agent="agent_environments:lookup_agent")
SAMPLING = SamplingConfig(n=2, seed=3)


@pytest.fixture(scope="module")
def smollm2():
    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf_path()),
                                         gguf_file=SMOLLM2_FILE)


@pytest.fixture(scope="module")
def qwen_style(smollm2):
    """test_agents' stand-in Qwen tokenizer, copied from the loaded SmolLM2 one."""
    tokenizer = copy.deepcopy(smollm2)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)
                          for token in QWEN_TOOL_TOKENS])
    tokenizer.chat_template = open(os.path.join(TEMPLATES, "qwen25.jinja")).read()
    return tokenizer


class SeededEngine(ScriptedEngine):
    """A ScriptedEngine that also records each request's seed and token limit."""

    def __init__(self, turns):
        super().__init__(turns)
        self.sampling = {}

    def add_requests(self, requests):
        self.sampling.update({r.key: (r.sampling.seed, r.sampling.max_new_tokens,
                                      r.sampling.stop_token_ids) for r in requests})
        super().add_requests(requests)


def run_agent(tokenizer, agent, turns, config=AGENT, sampling=SAMPLING):
    runner = AgentRunner(config, agent, tokenizer)
    engine = SeededEngine(turns)
    try:
        return runner.run(engine, [record()], sampling, 512), engine
    finally:
        runner.close()


@pytest.mark.parametrize("template,character_turn,agent", [
    ("smollm2", None, lookup_agent), ("qwen_style", None, lookup_agent),
    ("smollm2", 1, lookup_agent), ("smollm2", None, openai_agents_lookup),
    ("smollm2", None, langchain_lookup)],
    ids=["smollm2", "qwen_style", "smollm2-by-character", "smollm2-openai-agents",
         "smollm2-langchain"])
def test_the_openai_path_gives_the_environments_trajectories(template, character_turn, agent,
                                                             request):
    """character_turn: that turn is sampled character by character, a tokenisation that
    rendering the conversation again would not give: only prompts that reuse the ids held
    keep it. The openai-agents SDK's and LangChain's agents run under SmolLM2's template, which
    renders no tool schemas (each library writes its own schema for the function, which a
    template that renders schemas would show the model instead of Lookup's)."""
    tokenizer = request.getfixturevalue(template)
    environment = runner_for(tokenizer)
    try:
        turns = sampled_turns(tokenizer, environment.chat, character_turn)
        environment_engine = SeededEngine(turns)
        expected = environment.run(environment_engine, [record()], SAMPLING, 512)
    finally:
        environment.close()
    generation, engine = run_agent(tokenizer, agent, turns)
    assert generation.prompts == expected.prompts
    assert engine.returned == environment_engine.returned  # same requests, keys and prompts
    assert engine.sampling == environment_engine.sampling  # same seeds per turn
    for got, want in zip(generation.completions, expected.completions, strict=True):
        assert (got.prompt_index, got.sample_index) == (want.prompt_index, want.sample_index)
        assert got.token_ids == want.token_ids
        assert got.sampled == want.sampled and got.logprobs == want.logprobs
        assert (got.finish_reason, got.response_text) == (want.finish_reason, SCRIPT[-1])
        for name in ("reward", "turns", "tool_calls", "model_tokens", "observation_tokens",
                     "truncated"):
            assert got.episode[name] == want.episode[name], name
        assert got.episode["history_rewrites"] == got.episode["agent_failures"] == 0
        assert [m["content"] for m in got.episode["messages"]] == \
            [m["content"] for m in want.episode["messages"]]


def test_a_client_rewriting_its_history_gives_a_valid_counted_trajectory(smollm2):
    """The rewritten question breaks the chain after the first completion: the trajectory is
    the last prompt and answer, trained on the two turns that follow the rewrite."""
    turns = sampled_turns(smollm2, lookup_chat(smollm2))
    generation, engine = run_agent(smollm2, editing_agent, turns)
    completion = generation.completions[0]
    episode = completion.episode
    assert (episode["history_rewrites"], episode["turns"], episode["reward"]) == (1, 2, 3.0)
    prompt, sampled, _ = engine.turns_of("p0/s0")[-1]
    assert generation.prompts[0] + completion.token_ids == prompt + sampled
    kept = engine.turns_of("p0/s0")[1:]
    assert [t for t, m in zip(completion.token_ids, completion.sampled) if m] == \
        [t for _, ids, _ in kept for t in ids]
    assert [p for p, m in zip(completion.logprobs, completion.sampled) if m] == \
        [p for _, _, logprobs in kept for p in logprobs]
    assert all(p == 0 for p, m in zip(completion.logprobs, completion.sampled) if not m)
    text = smollm2.apply_chat_template(episode["messages"], tokenize=False)
    assert "Quickly." in text and text.startswith(smollm2.decode(prompt + sampled))


async def tool_dropping_agent(row, base_url):
    """Offers Lookup's tools for the first completion only."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model="policy", messages=messages,
                                                 tools=tool_schemas(Lookup, {}))
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "call_0_0", "content": "7"}]
    await client.chat.completions.create(model="policy", messages=messages)
    await client.close()
    return 1.0


def test_changed_tools_are_a_rewrite_not_a_template_error(qwen_style):
    """Qwen's template renders the tools into the system prompt: with other tools the second
    prompt does not continue the first completion (counted), and only it is trained."""
    turns = sampled_turns(qwen_style, lookup_chat(qwen_style))
    generation, engine = run_agent(qwen_style, tool_dropping_agent, turns,
                                   sampling=SamplingConfig(seed=0))
    completion = generation.completions[0]
    assert (completion.episode["history_rewrites"], completion.episode["turns"]) == (1, 1)
    prompt, sampled, _ = engine.turns_of("p0/s0")[-1]
    assert generation.prompts[0] + completion.token_ids == prompt + sampled
    assert [t for t, m in zip(completion.token_ids, completion.sampled) if m] == sampled


def lookup_chat(tokenizer) -> ChatFormat:
    """The chat format of Lookup's episodes (what test_agents' script is encoded with)."""
    return ChatFormat(tokenizer, tool_schemas(Lookup, {}))


async def hanging_agent(row, base_url):
    await asyncio.sleep(60)


def test_failures_and_limits_are_counted(smollm2):
    """An agent raising after a completion, or running past agent_timeout_seconds: reward 0,
    counted. max_turns: the request past it is answered "length" with no tokens, and the
    episode is truncated."""
    turns = sampled_turns(smollm2, lookup_chat(smollm2))
    generation, _ = run_agent(smollm2, failing_agent, turns, sampling=SamplingConfig(seed=0))
    episode = generation.completions[0].episode
    assert (episode["reward"], episode["agent_failures"], episode["turns"]) == (0.0, 1, 1)
    hurried = MultiTurnConfig(agent=AGENT.agent, agent_timeout_seconds=0.2)
    generation, _ = run_agent(smollm2, hanging_agent, turns, hurried, SamplingConfig(seed=0))
    episode = generation.completions[0].episode
    assert (episode["reward"], episode["agent_failures"], episode["turns"]) == (0.0, 1, 0)
    assert generation.prompts[0] == lookup_chat(smollm2).encode(smollm2.apply_chat_template(
        record().prompt, tokenize=False, add_generation_prompt=True))
    limited = MultiTurnConfig(agent=AGENT.agent, max_turns=1)
    generation, engine = run_agent(smollm2, lookup_agent, turns, limited, SamplingConfig(seed=0))
    [completion] = generation.completions
    assert len(engine.returned) == 1 and completion.finish_reason == "length"
    assert (completion.episode["turns"], completion.episode["reward"]) == (1, 1.0)


async def probing_agent(row, base_url):
    """Requests the endpoint refuses, then one it answers with token ids and log-probs."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    refused = []
    for extra in ({"n": 2}, {"stream": True}, {"stop": ["\n"]},
                  {"messages": [{"content": "who am I?"}]}):
        try:
            await client.chat.completions.create(**{"model": "policy",
                                                    "messages": row["prompt"], **extra})
        except openai.BadRequestError as error:
            refused.append((error.status_code, error.body["message"]))
    response = await client.chat.completions.create(model="policy", messages=row["prompt"],
                                                    logprobs=True, max_tokens=3)
    await client.close()
    episode_id = base_url.split("/episodes/")[1].split("/")[0]
    async with httpx.AsyncClient() as http:  # as another local user would
        guessed = await http.post(base_url.replace(episode_id, "e1-p0-s0") + "/chat/completions",
                                  json={"model": "policy", "messages": row["prompt"]})
        oversized = await http.post(base_url + "/chat/completions",
                                    content=b" " * (MAX_BODY_BYTES + 1))
    PROBED.update(refused=refused, response=response, episode_id=episode_id,
                  guessed=guessed.status_code, oversized=oversized.status_code)
    return 1.0


PROBED = {}


def test_the_endpoint_speaks_openai_and_refuses_what_it_cannot_honour(smollm2):
    chat = lookup_chat(smollm2)
    turns = [chat.encode(SCRIPT[-1]) + [chat.end_of_turn_id]]
    generation, engine = run_agent(smollm2, probing_agent, turns, sampling=SamplingConfig(seed=0))
    codes, messages = zip(*PROBED["refused"])
    assert codes == (400, 400, 400, 400)
    assert messages[0].startswith("n=2 is not supported here: one choice per request")
    assert messages[1].startswith("stream=True is not supported here")
    assert messages[2].startswith("stop=['\\n'] is not supported here")
    assert messages[3] == 'messages[0]: a message must be an object with a "role" string'
    response = PROBED["response"]
    [(prompt, sampled, logprobs)] = engine.turns_of("p0/s0")
    assert response.prompt_token_ids == prompt and response.choices[0].token_ids == sampled
    assert len(sampled) == 3 and response.choices[0].finish_reason == "stop"
    assert [entry.logprob for entry in response.choices[0].logprobs.content] == logprobs
    assert response.choices[0].message.content == smollm2.decode(sampled)
    assert response.usage.completion_tokens == 3
    assert generation.completions[0].episode["reward"] == 1.0
    # Another local user can neither guess an episode's URL nor send it an unbounded body.
    assert len(PROBED["episode_id"].split("-p0-")[0]) >= 22  # 128 random bits
    assert (PROBED["guessed"], PROBED["oversized"]) == (404, 413)


def test_the_agent_is_configured_alone_and_must_be_an_async_function(smollm2):
    both = MultiTurnConfig(agent=AGENT.agent, environment="agent_environments:Lookup")
    assert any("rollout.multi_turn.agent='agent_environments:lookup_agent' and "
               "rollout.multi_turn.environment='agent_environments:Lookup'" in error
               and "exclude each other" in error for error in both.errors())
    assert both.enabled and MultiTurnConfig(agent=AGENT.agent).errors() == []
    assert MultiTurnConfig(agent="run").errors() == [
        "rollout.multi_turn.agent='run' must be 'module:async_function'"]
    with pytest.raises(ValueError, match="agent='agent_environments:add' must be an async"):
        AgentRunner.build(MultiTurnConfig(agent="agent_environments:add"), smollm2)
    with pytest.raises(ValueError, match="agent='agent_environments:nope' cannot be loaded"):
        AgentRunner.build(MultiTurnConfig(agent="agent_environments:nope"), smollm2)
    config = with_agent(JobConfig(), lookup_agent)
    assert config.rollout.multi_turn.agent == "agent_environments:lookup_agent"
    runner = build_episode_runner(config, SimpleNamespace(tokenizer=smollm2))
    assert isinstance(runner, AgentRunner) and runner.agent is lookup_agent
    runner.close()
    broken = with_multi_turn(config, MultiTurnConfig(agent="agent_environments:add"))
    with pytest.raises(ConfigError, match="rollout.multi_turn: .*must be an async function"):
        build_episode_runner(broken, SimpleNamespace(tokenizer=smollm2))
    async def local_agent(row, base_url):
        return 0.0

    for agent in (local_agent, lambda row, base_url: 0.0):
        with pytest.raises(ValueError, match="must be a module-level async function"):
            with_agent(JobConfig(), agent)


def with_multi_turn(config: JobConfig, multi_turn: MultiTurnConfig) -> JobConfig:
    return dataclasses.replace(config, rollout=dataclasses.replace(config.rollout,
                                                                   multi_turn=multi_turn))
