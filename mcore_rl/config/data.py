"""Where the RL prompts come from and how they are turned into token ids and batches.

Prompts come from verl-style parquet / JSON-lines files and from built-in generators
(reasoning-gym tasks, the toy copy task used by CPU tests), in any combination. Every rule here
is checked before anything is loaded, and every file problem is found while loading, so a bad
dataset fails the job before the first rollout instead of in the middle of training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

FILE_EXTENSIONS = (".parquet", ".jsonl", ".json")
ON_BAD_ROW = ("error", "skip")
CHAT_TEMPLATE_MODES = ("auto", "true", "false")
# Validation generators run at seed + VAL_SEED_OFFSET. reasoning-gym seeds entry i with
# seed + i, so train and validation entries never coincide while size stays below the offset.
VAL_SEED_OFFSET = 1_000_000_000


@dataclass(frozen=True)
class ReasoningGymConfig:
    """Procedurally generated reasoning-gym tasks as a prompt source (data_source
    "reasoning_gym/<task>"); the entries travel in extra_info so the reward can score them."""

    tasks: list[str] = field(default_factory=list)
    """reasoning-gym dataset names (e.g. basic_arithmetic, chain_sum); empty: no such prompts."""

    size: int = 1000
    """Training prompts generated per task."""

    val_size: int = 0
    """Validation prompts generated per task (from a different seed than training)."""

    seed: int = 0
    """Generator seed of the training prompts; validation uses seed + VAL_SEED_OFFSET."""

    system_prompt: Optional[str] = None
    """System message asking for the answer in <answer> tags. None: reasoning-gym's default
    prompt; "": no system message (the question alone as the user message)."""

    task_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Generator settings per task, passed to the task's reasoning-gym config (its own names):
    e.g. {basic_arithmetic: {min_terms: 2, max_terms: 2, max_digits: 1, operators: [+]}}
    makes a small model's first task easy enough to learn from. Keys must be listed tasks."""


@dataclass(frozen=True)
class ToyConfig:
    """The toy copy task ("copy 7" -> "7") for tiny random models in CPU tests; it needs the
    tokenizer from mcore_rl.data.write_toy_tokenizer."""

    size: int = 0
    """Training prompts (0: none)."""

    val_size: int = 0
    """Validation prompts (from a different seed than training)."""

    seed: int = 0
    """Seed of the training prompts' digits; validation uses seed + VAL_SEED_OFFSET."""


@dataclass(frozen=True)
class DataConfig:
    """Prompt sources, their encoding and the order they are visited in."""

    train_files: list[str] = field(default_factory=list)
    """Training prompt files: .parquet, or .jsonl/.json (JSON lines; a .json file holding one
    JSON array is read as that array). Columns as in verl: prompt, data_source,
    reward_model.ground_truth, extra_info."""

    val_files: list[str] = field(default_factory=list)
    """Validation prompt files, same format."""

    prompt_key: str = "prompt"
    """Column holding the prompt: a string, or chat messages [{"role": ..., "content": ...}]."""

    max_prompt_tokens: int = 1024
    """Prompts longer than this (after the chat template) are dropped at load time and counted."""

    apply_chat_template: str = "auto"
    """auto: chat messages get the tokenizer's chat template (with the generation prompt), text
    is tokenized as is; true: text is wrapped as one user message and templated too; false: no
    template (chat-message prompts are then an error)."""

    on_bad_row: str = "error"
    """A malformed row (bad JSON, no prompt, bad messages, ...): "error" stops at load time
    naming the file and row; "skip" drops it and counts it."""

    shuffle: bool = True
    """Visit prompts in a seeded random order, reshuffled every epoch (False: file order)."""

    seed: int = 1
    """Seed of the prompt order."""

    tokenizer: Optional[str] = None
    """HF tokenizer folder or name; None: the model's own (init.hf_path or checkpoint)."""

    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    """Built-in reasoning-gym prompt source."""

    toy: ToyConfig = field(default_factory=ToyConfig)
    """Built-in toy copy task."""

    def chat_template_mode(self) -> str:
        """apply_chat_template as one of auto/true/false (YAML `true` arrives as "True")."""
        return str(self.apply_chat_template).strip().lower()

    def errors(self) -> list[str]:
        """Broken rules, each naming its field (empty when valid)."""
        errors = []
        for name in ("train_files", "val_files"):
            for path in getattr(self, name):
                if not str(path).lower().endswith(FILE_EXTENSIONS):
                    errors.append(f"data.{name}: {path!r} must end with one of "
                                  f"{', '.join(FILE_EXTENSIONS)}")
        if not self.prompt_key:
            errors.append("data.prompt_key must not be empty")
        if self.max_prompt_tokens < 1:
            errors.append(f"data.max_prompt_tokens={self.max_prompt_tokens} must be at least 1")
        if self.chat_template_mode() not in CHAT_TEMPLATE_MODES:
            errors.append(f"data.apply_chat_template={self.apply_chat_template!r} must be one of "
                          f"{', '.join(CHAT_TEMPLATE_MODES)}")
        if self.on_bad_row not in ON_BAD_ROW:
            errors.append(f"data.on_bad_row={self.on_bad_row!r} must be one of "
                          f"{', '.join(ON_BAD_ROW)}")
        errors += self._reasoning_gym_errors()
        if self.toy.size < 0 or self.toy.val_size < 0:
            errors.append(f"data.toy.size={self.toy.size} and data.toy.val_size="
                          f"{self.toy.val_size} must be >= 0")
        if not (self.train_files or self.reasoning_gym.tasks or self.toy.size):
            errors.append("no training prompts: set data.train_files, data.reasoning_gym.tasks "
                          "or data.toy.size")
        return errors

    def _reasoning_gym_errors(self) -> list[str]:
        source = self.reasoning_gym
        if not source.tasks:
            return []
        errors = []
        if source.size < 1:
            errors.append(f"data.reasoning_gym.size={source.size} must be at least 1")
        if source.val_size < 0:
            errors.append(f"data.reasoning_gym.val_size={source.val_size} must be >= 0")
        duplicates = sorted({task for task in source.tasks if source.tasks.count(task) > 1})
        if duplicates:
            errors.append(f"data.reasoning_gym.tasks lists {duplicates} more than once")
        stray = sorted(set(source.task_kwargs) - set(source.tasks))
        if stray:
            errors.append(f"data.reasoning_gym.task_kwargs has settings for {stray}, which "
                          f"data.reasoning_gym.tasks does not list")
        try:
            from reasoning_gym.factory import DATASETS
        except ImportError:
            return errors + ["data.reasoning_gym.tasks is set but reasoning_gym is not "
                             "installed (pip install reasoning-gym)"]
        unknown = [task for task in source.tasks if task not in DATASETS]
        if unknown:
            errors.append(f"data.reasoning_gym.tasks: unknown task(s) {unknown}; reasoning-gym "
                          f"has {len(DATASETS)} (reasoning_gym.factory.DATASETS)")
        return errors
