"""Multi-turn episodes: the trained tokens are the sampled tokens, and every other token is the
chat template's.

The episodes run through the real EpisodeRunner, the real sandbox and real chat templates
(SmolLM2's, and Qwen2.5's with tools on a stand-in tokenizer: SmolLM2's BPE plus Qwen's added
tool tokens, since no Qwen tokenizer is available offline). The engine here is scripted: it
returns chosen token ids for each turn, so that the test knows exactly what was "sampled"
(one turn is sampled in a non-canonical tokenisation, character by character, which decoding
and encoding again would not reproduce). The references are transformers' apply_chat_template
over the whole conversation and its assistant-token mask; vLLM's own sampling is checked against
the trainer in tests/test_agents_rl.py.
"""

import dataclasses
import json
import os

import pytest
import torch
from tokenizers import AddedToken
from transformers import AutoTokenizer

from mcore_rl.agents import ChatFormat, EpisodeRunner, EpisodeSpec, TemplateMismatch, tool_schemas
from mcore_rl.agents.session import environment_class, function_tools
from mcore_rl.config.agents import MultiTurnConfig, ToolSandboxConfig
from mcore_rl.config.rollout import SamplingConfig
from mcore_rl.conversion.gguf_to_hf import SMOLLM2_FILE, smollm2_gguf_path
from mcore_rl.data.records import PromptRecord
from mcore_rl.rollout import FinishedSample, RolloutEngine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = os.path.join(REPO, "tests", "data", "chat_templates")
ENVIRONMENT = "agent_environments:Lookup"
QWEN_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                    "<think>", "</think>"]


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


SCRIPT = [call("lookup", key="a"),
          call("lookup", key="b") + "\n" + call("lookup", key="c"),  # two tool messages follow
          "The values are 7, 3 and 4."]


@pytest.fixture(scope="module")
def smollm2():
    folder = os.path.dirname(smollm2_gguf_path())
    return AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_FILE)


@pytest.fixture(scope="module")
def qwen_style():
    return stand_in_qwen("qwen25.jinja")


def stand_in_qwen(template: str):
    """SmolLM2's tokenizer with Qwen's added tool tokens and a Qwen chat template."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf_path()),
                                              gguf_file=SMOLLM2_FILE)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)
                          for token in QWEN_TOOL_TOKENS])
    tokenizer.chat_template = open(os.path.join(TEMPLATES, template)).read()
    return tokenizer


class ScriptedEngine(RolloutEngine):
    """Answers turn t of every episode with `turns[t]` encoded by `encode`, one turn per step,
    and records what it returned. With `routes`, each answer carries MoE routes for the tokens
    its request fed (the prompt, the answer but its last token): expert t in every slot."""

    supports_streaming = True

    def __init__(self, turns: list[list[int]], routes: bool = False):
        self.turns, self.routes = turns, routes
        self.queue, self.returned = [], {}

    def add_requests(self, requests):
        self.queue += requests

    def has_unfinished(self, local_work=False):
        return bool(self.queue) or local_work

    def step(self):
        finished = []
        for request in self.queue:
            turn = int(request.key.rpartition("/t")[2])
            ids = self.turns[turn][:request.sampling.max_new_tokens]
            logprobs = [-0.01 * (i + 1) - turn for i in range(len(ids))]
            self.returned[request.key] = (list(request.prompt), ids, logprobs)
            fed = len(request.prompt) + len(ids) - 1
            routes = torch.full((fed, 1, 2), turn, dtype=torch.int16) if self.routes else None
            finished.append(FinishedSample(request.key, ids, logprobs, "stop",
                                           routed_experts=routes))
        self.queue = []
        return finished

    def turns_of(self, episode: str) -> list[tuple]:
        """(prompt, ids, logprobs) of each turn of episode "p<prompt>/s<sample>", in order."""
        return [value for key, value in sorted(self.returned.items()) if f"/{episode}/" in key]

    def generate(self, *args):
        raise NotImplementedError

    update_weights = sleep = wake = generate


def runner_for(tokenizer, config: MultiTurnConfig = MultiTurnConfig(environment=ENVIRONMENT),
               probe_record=None):
    spec = EpisodeSpec(config.environment, tuple(config.tools), config.tool_parser, 5.0, 512)
    schemas = tool_schemas(environment_class(spec.environment), function_tools(spec.tools))
    chat = ChatFormat(tokenizer, schemas, dict(config.template_kwargs))
    return EpisodeRunner.build(config, chat, spec, probe_record)


def sampled_turns(tokenizer, chat: ChatFormat, character_turn: int | None = None):
    turns = []
    for index, text in enumerate(SCRIPT):
        if index == character_turn:  # a tokenisation encoding the text again would not give
            ids = [i for c in text for i in tokenizer(c, add_special_tokens=False)["input_ids"]]
        else:
            ids = chat.encode(text)
        turns.append(ids + [chat.end_of_turn_id])
    return turns


def record(prompt="What is stored under a, b and c?"):
    return PromptRecord(0, [{"role": "user", "content": prompt}], "toy/copy", "7", {})


@pytest.mark.parametrize("template", ["smollm2", "qwen_style"])
def test_episode_tokens_are_the_sampled_tokens_and_the_template(template, request):
    tokenizer = request.getfixturevalue(template)
    runner = runner_for(tokenizer)
    try:
        turns = sampled_turns(tokenizer, runner.chat)
        engine = ScriptedEngine(turns)
        generation = runner.run(engine, [record()], SamplingConfig(n=2, seed=3), 512)
    finally:
        runner.close()
    completion = generation.completions[1]
    messages = completion.episode["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool",
                                             "tool", "assistant"]
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["7", "3", "4"]
    ids = generation.prompts[0] + completion.token_ids
    full = tokenizer.apply_chat_template(messages, tools=runner.chat.tools, tokenize=True,
                                         return_dict=True)["input_ids"]
    assert ids == list(full)[:len(ids)]
    assert tokenizer.decode(full[len(ids):]) == "\n"  # the template's last separator
    prompt_length = len(generation.prompts[0])
    sampled = [t for t, m in zip(completion.token_ids, completion.sampled) if m]
    assert sampled == [t for turn in turns for t in turn]
    assert sampled_positions(completion, prompt_length) == assistant_positions(
        tokenizer, messages, runner.chat.tools, template)
    logprobs = [p for p, m in zip(completion.logprobs, completion.sampled) if m]
    assert logprobs == [p for _, _, turn in engine.turns_of("p0/s1") for p in turn]
    assert all(p == 0 for p, m in zip(completion.logprobs, completion.sampled) if not m)
    assert completion.episode["reward"] == 3.0 and completion.response_text == SCRIPT[-1]
    assert completion.episode["tool_calls"] == 3 and completion.episode["turns"] == 3


def test_each_token_replays_the_route_of_the_request_that_fed_it_first(smollm2):
    """r3 across turns: an episode's routes are each token's from the first engine request
    that fed it: a model turn's tokens from the request that sampled them, the observation
    after it (and the turn's last token) from the next turn's prefill, which may route them
    otherwise (under new weights, or other numerics)."""
    runner = runner_for(smollm2)
    try:
        engine = ScriptedEngine(sampled_turns(smollm2, runner.chat), routes=True)
        generation = runner.run(engine, [record()], SamplingConfig(n=1, seed=3), 512)
    finally:
        runner.close()
    completion = generation.completions[0]
    row = generation.prompts[0] + completion.token_ids
    fed_by = [len(prompt) + len(ids) - 1 for prompt, ids, _ in engine.turns_of("p0/s0")]
    expected = [next(turn for turn, end in enumerate(fed_by) if position < end)
                for position in range(len(row) - 1)]
    assert completion.routed_experts[:, 0, 0].tolist() == expected
    assert sorted(set(expected)) == [0, 1, 2]


def sampled_positions(completion, offset: int) -> list[int]:
    return [offset + i for i, m in enumerate(completion.sampled) if m]


def assistant_positions(tokenizer, messages, tools, template) -> list[int]:
    """Token positions of the assistant contents and their end-of-turn token in the full
    render: transformers' assistant mask from a {% generation %} copy of SmolLM2's template,
    or character spans mapped through the tokenizer's offsets (Qwen2.5's)."""
    if template == "smollm2":
        marked = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf_path()),
                                               gguf_file=SMOLLM2_FILE)
        marked.chat_template = SMOLLM2_GENERATION_TEMPLATE
        assert marked.apply_chat_template(messages, tokenize=False) == \
            tokenizer.apply_chat_template(messages, tokenize=False)
        out = marked.apply_chat_template(messages, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        return [i for i, m in enumerate(out["assistant_masks"]) if m]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    spans, start = [], 0
    for message in messages:
        if message["role"] == "assistant":
            start = text.index(message["content"] + "<|im_end|>", start)
            spans.append((start, start + len(message["content"]) + len("<|im_end|>")))
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [i for i, (begin, end) in enumerate(offsets["offset_mapping"])
            if any(s <= begin and end <= e for s, e in spans)]


SMOLLM2_GENERATION_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")



def test_a_non_canonical_sampling_is_trained_as_sampled(smollm2):
    runner = runner_for(smollm2)
    try:
        turns = sampled_turns(smollm2, runner.chat, character_turn=1)
        assert turns[1] != runner.chat.encode(SCRIPT[1]) + [runner.chat.end_of_turn_id]
        generation = runner.run(ScriptedEngine(turns), [record()], SamplingConfig(seed=0), 512)
    finally:
        runner.close()
    completion = generation.completions[0]
    assert [t for t, m in zip(completion.token_ids, completion.sampled) if m] == \
        [t for turn in turns for t in turn]
    text = smollm2.apply_chat_template(completion.episode["messages"], tokenize=False)
    assert text.startswith(smollm2.decode(generation.prompts[0] + completion.token_ids))


def test_templates_that_rewrite_earlier_turns_are_refused_or_ended():
    """Qwen3 without thinking feeds the model an empty think block that later renders drop:
    not prefix-preserving. Refused at start-up (template_mismatch=error, from a probe
    conversation), or run with each episode ended at its first observation (end)."""
    qwen3 = stand_in_qwen("qwen3.jinja")
    kwargs = {"enable_thinking": False}
    with pytest.raises(TemplateMismatch, match="not prefix-preserving .*enable_thinking.*think"):
        runner_for(qwen3, MultiTurnConfig(environment=ENVIRONMENT, template_kwargs=kwargs))
    runner = runner_for(qwen3, MultiTurnConfig(environment=ENVIRONMENT, template_mismatch="end",
                                               template_kwargs=kwargs))
    try:
        engine = ScriptedEngine(sampled_turns(qwen3, runner.chat))
        episode = runner.run(engine, [record()], SamplingConfig(seed=0), 512).completions[0]
    finally:
        runner.close()
    assert episode.episode["template_mismatches"] == 1 and episode.episode["turns"] == 1
    assert episode.finish_reason == "length"


def run_script(tokenizer, script: list[str], config: MultiTurnConfig, samples: int = 1):
    runner = runner_for(tokenizer, config)
    try:
        turns = [runner.chat.encode(text) + [runner.chat.end_of_turn_id] for text in script]
        return runner.run(ScriptedEngine(turns), [record()], SamplingConfig(n=samples, seed=0),
                          512).completions
    finally:
        runner.close()


def tool_messages(completion) -> list[str]:
    return [m["content"] for m in completion.episode["messages"] if m["role"] == "tool"]


def test_bad_tool_calls_become_error_observations(smollm2):
    script = ['<tool_call>\n{"name": lookup}\n</tool_call>', call("rm", path="/"),
              call("lookup", k="a"), call("lookup", key="z"), "done"]
    [completion] = run_script(smollm2, script, MultiTurnConfig(environment=ENVIRONMENT,
                                                               max_turns=5))
    errors = tool_messages(completion)
    assert errors[0].startswith("error: the tool call is not valid JSON")
    assert errors[1] == "error: unknown tool 'rm'; the tools are lookup, spin"
    assert errors[2] == "error: lookup: missing a required argument: 'key'"
    assert errors[3] == "error: KeyError: 'z'"
    episode = completion.episode
    assert (episode["turns"], episode["parse_failures"], episode["tool_calls"],
            episode["tool_errors"], episode["truncated"]) == (5, 1, 3, 3, 0)


def test_a_hanging_tool_is_killed_and_the_job_goes_on(smollm2):
    config = MultiTurnConfig(environment=ENVIRONMENT,
                             sandbox=ToolSandboxConfig(timeout_seconds=1.0),
                             python_timeout_seconds=0.5)
    completions = run_script(smollm2, [call("spin", seconds=5), "done"], config, samples=2)
    for completion in completions:
        assert completion.episode["tool_timeouts"] == 1 and completion.finish_reason == "length"
        assert completion.episode["reward"] is None and completion.episode["turns"] == 1


def test_an_environment_that_fails_to_reset_ends_its_episode_not_the_job(smollm2):
    """The reset raises for one prompt: its episodes end unplayed (the prompt alone, nothing
    sampled, counted in environment_failures), the other prompt's run as usual."""
    config = MultiTurnConfig(environment="agent_environments:FlakyReset")
    runner = runner_for(smollm2, config)
    try:
        engine = ScriptedEngine(sampled_turns(smollm2, runner.chat))
        generation = runner.run(engine, [record("broken: what is under a?"), record()],
                                SamplingConfig(n=2, seed=0), 512)
    finally:
        runner.close()
    failed = [c for c in generation.completions if c.prompt_index == 0]
    played = [c for c in generation.completions if c.prompt_index == 1]
    assert len(failed) == len(played) == 2
    for completion in failed:
        assert completion.episode["environment_failures"] == 1
        assert completion.finish_reason == "length" and not any(completion.sampled_mask())
        assert completion.episode["turns"] == 0
    assert generation.prompts[0] == runner.chat.prompt_ids(
        [{"role": "user", "content": "broken: what is under a?"}])
    for completion in played:
        assert completion.episode["environment_failures"] == 0
        assert completion.episode["reward"] == 3.0 and completion.episode["turns"] == 3


def test_plain_tools_the_python_tool_and_the_limits(smollm2):
    config = MultiTurnConfig(tools=["python", "agent_environments:add"], max_turns=3,
                             max_observation_tokens=4)
    script = [call("python", code="print('x ' * 50)"), call("python", code="print(6 * 7)"),
              call("add", a=2, b=3), "done"]
    [completion] = run_script(smollm2, script, config)
    outputs = tool_messages(completion)
    assert smollm2(outputs[0], add_special_tokens=False)["input_ids"] == \
        smollm2("x x x x", add_special_tokens=False)["input_ids"]
    assert outputs[1].strip() == "42" and len(outputs) == 2
    episode = completion.episode
    assert episode["observations_truncated"] == 1 and episode["tool_calls"] == 3
    assert episode["turns"] == 3 and completion.finish_reason == "length"  # max_turns


def test_the_calculator_recipes_demonstrations_are_its_episodes_token_for_token(smollm2,
                                                                                  tmp_path):
    """scripts/smollm2_tools_recipe.sh: each SFT row of a demonstration, as `mcore-rl sft`
    encodes it (prompt, response, end of sequence), is a prefix of the episode the same turns
    make under RL with the recipe's config, the calculator answering in the sandbox; the
    answer it reads is reasoning-gym's, which the task's own scorer gives 1."""
    from mcore_rl.config import load_config
    from mcore_rl.data.reasoning_gym_source import reasoning_gym_records
    from mcore_rl.quickstart import tools_recipe
    from mcore_rl.rewards.reasoning_gym_tasks import reasoning_gym_score
    from mcore_rl.sft.data import Demonstration, encode_demonstrations

    config = load_config(os.path.join(REPO, "configs", "grpo_smollm2_tools.yaml"))
    assert config.rollout.multi_turn.tools == [tools_recipe.TOOL]
    [question] = reasoning_gym_records(config.data.reasoning_gym, 1, seed=7)
    demonstration = tools_recipe.demonstration(question)
    rows = encode_demonstrations([Demonstration(row["prompt"], row["response"])
                                  for row in tools_recipe.sft_rows([question])],
                                 smollm2, "auto", 512).token_ids
    runner = runner_for(smollm2, config.rollout.multi_turn)
    try:
        turns = [runner.chat.encode(message["content"]) + [runner.chat.end_of_turn_id]
                 for message in demonstration if message["role"] == "assistant"]
        generation = runner.run(ScriptedEngine(turns), [question], SamplingConfig(n=1, seed=0),
                                512)
    finally:
        runner.close()
    [completion] = generation.completions
    episode = generation.prompts[0] + completion.token_ids
    assert len(rows) == 2 and all(episode[:len(row)] == row for row in rows)
    assert tool_messages(completion) == [str(question.ground_truth)]
    assert completion.response_text == str(question.ground_truth)
    assert reasoning_gym_score(question.data_source, completion.response_text,
                               question.ground_truth, question.extra_info) == 1.0
    tools_recipe.prepare(str(tmp_path), config, 3)
    written = [json.loads(line) for line in open(tmp_path / "demos_train.jsonl")]
    assert [row["response"] == call("calculator", expression=row["prompt"][-1]["content"][
        len("Calculate "):-1]) for row in written] == [True, False] * 3


def test_the_calculator_computes_what_python_does_and_refuses_the_rest():
    """Random expressions of every operator it reads against Python's own arithmetic; what is
    not arithmetic, or too large to compute, is a ValueError the model reads."""
    import random

    from mcore_rl.agents.calculator import calculator

    rng = random.Random(0)

    def expression(depth: int) -> str:
        if depth == 0 or rng.random() < 0.3:
            return rng.choice([str(rng.randint(0, 999)), f"{rng.uniform(0, 99):.2f}"])
        operator = rng.choice(["+", "-", "*", "/", "//", "%"])
        left, right = expression(depth - 1), expression(depth - 1)
        return rng.choice(["{} {} {}", "({} {} {})", "-{} {} {}"]).format(left, operator, right)

    checked = 0
    for _ in range(300):
        text = expression(3)
        try:
            expected = eval(text)  # the reference: Python's arithmetic on a literal expression
        except ZeroDivisionError:
            with pytest.raises(ValueError, match="division by zero"):
                calculator(text)
            continue
        value = float(calculator(text))
        assert value == pytest.approx(expected, rel=1e-12, abs=1e-12), text
        checked += 1
    assert checked > 250
    assert calculator("2 ** 10") == "1024" and calculator("7 / 2") == "3.5"
    assert calculator("6 / 3") == "2"
    for text, message in [("__import__('os').getcwd()", "unsupported"), ("x + 1", "unsupported"),
                          ("'a' * 3", "unsupported"), ("3 +", "not an arithmetic expression"),
                          ("9 ** 9 ** 9", "more than 100 digits"),
                          ("9" * 60 + " * " + "9" * 60, "more than 100 digits"),
                          ("1" * 300, "longer than 256 characters")]:
        with pytest.raises(ValueError, match=message):
            calculator(text)


@pytest.mark.parametrize("environment,message", [
    ("agent_environments:Undocumented", "tool 'lookup' .* docstring"),
    ("agent_environments:Nope", "environment='agent_environments:Nope' cannot be loaded"),
    ("agent_environments:add", "is not a subclass of mcore_rl.agents.Environment"),
    ("agent_environments:Broken", "could not be made in its sandbox: .*no table today")])
def test_a_bad_environment_is_refused_before_any_rollout(smollm2, environment, message):
    with pytest.raises(ValueError, match=message):
        runner_for(smollm2, MultiTurnConfig(environment=environment)).close()


def test_an_environment_the_sandbox_keeps_from_its_file_is_stopped_at_start(smollm2, tmp_path):
    """The environment resets on a real row before any rollout: one whose table file the
    sandbox may not read stops the job, naming the row and the setting; allowed, it starts."""
    (tmp_path / "table.json").write_text('{"a": "7"}')
    probe = PromptRecord(3, "What is under a?", "toy/copy", "7",
                         {"table_file": str(tmp_path / "table.json")})
    config = MultiTurnConfig(environment="agent_environments:TableFromFile")
    with pytest.raises(ValueError, match=r"could not be reset on row 3 \(data_source 'toy/copy'"
                       r"\): PermissionError: .*rollout\.multi_turn\.sandbox\.readable"):
        runner_for(smollm2, config, probe).close()
    sandbox = dataclasses.replace(config.sandbox, readable=(str(tmp_path),))
    runner_for(smollm2, dataclasses.replace(config, sandbox=sandbox), probe).close()


HERMES_CASES = ["Let me check.\n" + call("lookup", key="a"),
                call("lookup", key="b") + "\n" + '<tool_call>{"name":"lookup","arguments":'
                '{"key":"c"}}</tool_call>',
                "The answer is 7.", '<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}',
                call("rm_rf", path="/")]


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="needs vllm")
def test_the_hermes_parser_reads_calls_as_vllms_does(smollm2):
    """Well-formed calls (one, two, none, an unclosed last one, an unknown tool) as vLLM's own
    hermes parser reads them; malformed ones raise here where vLLM reads no call."""
    from vllm.tool_parsers import ToolParserManager

    from mcore_rl.agents.tool_calls import ToolCallError, parse_hermes

    vllm_parser = ToolParserManager.get_tool_parser("hermes")(smollm2)
    for text in HERMES_CASES:
        info = vllm_parser.extract_tool_calls(text, None)
        expected = [(c.function.name, json.loads(c.function.arguments))
                    for c in info.tool_calls] if info.tools_called else []
        assert [(c.name, c.arguments) for c in parse_hermes(text)] == expected, text
    with pytest.raises(ToolCallError, match="not valid JSON"):
        parse_hermes('<tool_call>{"name": lookup}</tool_call>')


def test_episodes_do_not_wait_for_each_other(smollm2):
    """While the slow episode's environment works on its first turn, the fast one runs its
    three turns through the engine (no barrier per turn)."""
    runner = runner_for(smollm2, MultiTurnConfig(environment="agent_environments:SlowFirstPrompt"))
    try:
        engine = ScriptedEngine(sampled_turns(smollm2, runner.chat))
        records = [record("slow: what is stored under a, b and c?"), record()]
        runner.run(engine, records, SamplingConfig(seed=0), 512)
    finally:
        runner.close()
    order = list(engine.returned)  # the order the engine finished the turns in
    assert order.index("e1/p1/s0/t2") < order.index("e1/p0/s0/t1")


def test_trainer_takes_an_environment_class_that_its_processes_can_import():
    from agent_environments import Lookup

    from mcore_rl.config import load_config
    from mcore_rl.rl.api import with_environment

    config = with_environment(load_config(None, []), Lookup)
    assert config.rollout.multi_turn.environment == "agent_environments:Lookup"

    class Local(Lookup):
        pass

    with pytest.raises(ValueError, match="Local is defined inside a function: .* top level"):
        with_environment(config, Local)


def test_an_environment_that_scores_its_episodes_needs_no_reward_function():
    """Lookup defines get_reward: its rows' data_source needs no reward function at start; an
    episode it returns None for scores 0 as a counted reward error. The base Environment
    scores nothing itself, so such a data_source is still refused."""
    from mcore_rl.config import load_config
    from mcore_rl.rewards import RewardRequest, RuleRewards
    from mcore_rl.rewards.registry import UnknownDataSourceError
    from mcore_rl.rl.job_rewards import reward_config

    def rewards(environment: str) -> RuleRewards:
        return RuleRewards(reward_config(load_config(None, [
            f"rollout.multi_turn.environment={environment}", "reward.num_workers=0"])))

    scored = rewards("agent_environments:Lookup")
    scored.check_data_sources({"scripted"})
    (result,) = scored.score([RewardRequest("episode0", "scripted", "the answer")])
    assert result.score == 0.0 and "get_reward returned None" in result.error
    with pytest.raises(UnknownDataSourceError, match="no reward function for data_source "
                                                     "'scripted'"):
        rewards("agent_environments:Undocumented").check_data_sources({"scripted"})
