"""The configuration reference: every field documented, docs/configuration.md current, and the
defaults it shows equal to the dataclasses' own."""

import dataclasses
import json
import os
import re
import subprocess
import sys

from mcore_rl.config import JobConfig
from mcore_rl.config.reference import (DOC_PATH, REGENERATE_COMMAND, entries, field_docs,
                                       missing_docs, render)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = re.compile(r"^\| `([\w.]+)` \| .*? \| `(.*?)` \| ")


def committed_reference() -> str:
    with open(os.path.join(ROOT, DOC_PATH), encoding="utf-8") as handle:
        return handle.read()


def defaults_in(markdown: str) -> dict:
    """{dotted key: default} parsed back from the table rows (JSON in backticks)."""
    return {match[1]: json.loads(match[2].replace("\\|", "|"))
            for match in map(ROW.match, markdown.splitlines()) if match}


def value_at(config, key: str):
    """The value under a dotted key, or a KeyError when the path crosses an unset (None)
    section."""
    for name in key.split("."):
        if config is None:
            raise KeyError(key)
        config = getattr(config, name)
    return config


def test_every_config_field_has_a_docstring():
    missing = missing_docs()
    assert not missing, ("config fields without a docstring (add a string literal right after "
                         "each field in mcore_rl/config/*.py): " + ", ".join(missing))


def test_committed_reference_is_current():
    assert committed_reference() == render(), (
        f"{DOC_PATH} is stale (a config field or docstring changed); regenerate it: "
        f"{REGENERATE_COMMAND}")


def test_defaults_shown_equal_the_dataclass_defaults():
    shown, job = defaults_in(committed_reference()), JobConfig()
    known = ["rollout.sampling.max_new_tokens", "rollout.eval_sampling.temperature",
             "critic.optimizer.lr", "optimizer.lr", "model.num_kv_heads", "data.train_files",
             "rollout.sampling.stop_token_ids", "reward.format_pattern", "reward.functions",
             "trainer.save_signal", "trainer.wandb_project"]
    assert set(known) <= set(shown)
    compared = 0
    for key, value in shown.items():
        try:
            expected = value_at(job, key)
        except KeyError:  # e.g. model.rope_scaling.*: defaults of a section unset by default
            continue
        expected = list(expected) if isinstance(expected, tuple) else expected
        assert value == expected and type(value) is type(expected), key
        compared += 1
    assert compared > 100
    # Factory defaults are shown as a job gets them, not as the section's class declares them.
    assert shown["critic.optimizer.lr"] != shown["actor.optimizer.lr"]


def test_every_field_is_listed_once():
    keys = [entry.key for entry in entries()]
    assert len(keys) == len(set(keys))
    assert {"rollout.sampling.n", "critic.init_path", "critic.micro_batch_size",
            "data.reasoning_gym.tasks", "trainer.wandb_run_name"} <= set(keys)
    expected_sections = [f"## {item.name}" for item in dataclasses.fields(JobConfig)]
    assert [line for line in render().splitlines() if line.startswith("## ")] == \
        expected_sections


@dataclasses.dataclass(frozen=True)
class _Base:
    documented: int = 1
    """First line
    and a second one."""

    undocumented: int = 2


@dataclasses.dataclass(frozen=True)
class _Child(_Base):
    extra: str = "x"
    """Declared by the child."""


def test_field_docs_reads_attribute_docstrings_and_inherits():
    assert field_docs(_Child) == {"documented": "First line and a second one.",
                                  "extra": "Declared by the child."}


def test_script_prints_the_reference():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "config_reference.py")],
                            capture_output=True, text=True, check=True, cwd="/")
    assert result.stdout == render()
