"""The calculator recipe's demonstrations (scripts/smollm2_tools_recipe.sh): SmolLM2-135M learns
to call `mcore_rl.agents.calculator:calculator` on arithmetic it cannot do in its head.

The task, its system prompt and the tool are read from the GRPO config
(configs/grpo_smollm2_tools.yaml), which owns them: the demonstrations show the model exactly
the conversation its episodes will hold. A demonstration is the episode that solves a question:

    system     Use the calculator tool, then answer with just the number.
    user       Calculate 814 + 707 - 965 + 861.
    assistant  <tool_call>{"name": "calculator", ...: "814 + 707 - 965 + 861"}}</tool_call>
    tool       1417
    assistant  1417

and becomes one SFT row per assistant turn (the conversation before it as the prompt), so SFT
trains the tokens RL samples, each in its context. The tool's answer is computed by the tool
itself and must equal reasoning-gym's answer, so a demonstration can never teach a wrong
number.

    <dir>/demos_train.jsonl, demos_val.jsonl     the demonstrations, one row per turn
"""

from __future__ import annotations

import json
from pathlib import Path

from mcore_rl.agents.calculator import calculator
from mcore_rl.config.job import JobConfig
from mcore_rl.data.reasoning_gym_source import ENTRY_KEY, reasoning_gym_records
from mcore_rl.data.records import PromptRecord

from .task import episode_sft_rows, write_jsonl

TOOL = "mcore_rl.agents.calculator:calculator"
DEMONSTRATION_SEED = 500_000
"""reasoning-gym seed of the demonstrations: neither the GRPO prompts' (data.reasoning_gym.seed,
0) nor the held-out questions' (seed + 1e9)."""
VALIDATION_DEMONSTRATIONS = 16


def call_text(expression: str) -> str:
    """The assistant turn that asks the calculator, in the hermes format the recipe parses."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def demonstration(record: PromptRecord) -> list[dict]:
    """The episode that solves `record` with one calculator call."""
    entry = record.extra_info[ENTRY_KEY]
    expression = entry["metadata"]["expression"]
    result = calculator(expression)
    if result != str(record.ground_truth):
        raise ValueError(f"the calculator gives {result} for {expression!r} where reasoning-gym "
                         f"answers {record.ground_truth}")
    return [*record.prompt,
            {"role": "assistant", "content": call_text(expression)},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": result}]


def sft_rows(records: list[PromptRecord]) -> list[dict]:
    """One SFT row per assistant turn of each record's demonstration."""
    return [row for record in records for row in episode_sft_rows(demonstration(record))]


def prepare(directory: str, config: JobConfig, demonstrations: int) -> None:
    """Writes the demonstrations of `config`'s reasoning-gym task into `directory`."""
    if TOOL not in config.rollout.multi_turn.tools:
        raise ValueError(f"rollout.multi_turn.tools={config.rollout.multi_turn.tools} must "
                         f"offer {TOOL!r}: the demonstrations call it")
    records = reasoning_gym_records(config.data.reasoning_gym,
                                    demonstrations + VALIDATION_DEMONSTRATIONS,
                                    seed=DEMONSTRATION_SEED)
    train, validation = records[:demonstrations], records[demonstrations:]
    root = Path(directory)
    write_jsonl(str(root / "demos_train.jsonl"), sft_rows(train))
    write_jsonl(str(root / "demos_val.jsonl"), sft_rows(validation))
    print(f"prepare-tools: {demonstrations} demonstrated episodes ({2 * demonstrations} SFT "
          f"rows) and {VALIDATION_DEMONSTRATIONS} for validation in {root}")
