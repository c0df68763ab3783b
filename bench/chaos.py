"""Chaos test: kill -9 the quickstart's GRPO run at seeded moments, resume it, compare.

    python bench/chaos.py [--kills 10] [--seed 0] [--placements colocated,split,split_async]
                          [--json F]        # also: agents_split_async
    python bench/chaos.py --report F       # the tables of an earlier run's results

For each placement (colocated: training PP2 + vLLM rollout TP2 on 2 ranks, as the quickstart;
split: 1 trainer + 1 rollout rank, max_staleness 0; split_async: the same with max_staleness 1,
rollouts one step ahead; agents_split_async: split_async on the agents example's multi-turn
episodes, whose updates land while episodes run) it runs the job once uninterrupted (the
reference), then again in a fresh folder, killing it K times at seeded moments
(runtime.faults: a phase - generation, weight sync, update, checkpoint save, evaluation - the
how-many-th entry into it, a rank, and whom to kill: the rank, torchrun, or torchrun's
whole process group, with `kill -9`), each time relaunching the same command, which resumes
from the newest complete checkpoint, until a launch finishes. After every exit it checks:
- no process of the job is left after a few seconds (found by a marker in their environment,
  which every descendant inherits);
- no shared-memory segment in /dev/shm and no private temporary folder of a rank is left;
- the relaunch resumed from the newest complete checkpoint (never from `step_*.incomplete`).
At the end it compares with the reference: which prompts each step trained on
(trained_prompts.jsonl: every prompt exactly once, at its step), and where promised (colocated,
split with max_staleness 0) the exported HF weights byte for byte and every step's training and
evaluation metrics (timings aside; a step redone after a kill is compared as last logged, by the
launch the run went on from). Exit status 0 only when all of it holds.

Reported per kill: the phase, target, the step reached, the step resumed from (steps redone),
the seconds the killed launch ran, and what was left; then the totals. The launches run on this
machine's loopback with free ports; each is bounded (--timeout).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from mcore_rl.observability.step_metrics import MACHINE_METRIC_PREFIXES  # noqa: E402
from mcore_rl.observability.trained_prompts import read_trained_prompts  # noqa: E402
from mcore_rl.runtime.faults import KILL_AT_VARIABLE, TARGETS, parse_kill_at  # noqa: E402
from mcore_rl.runtime.process_guard import TEMP_PREFIX, system_temp_dir  # noqa: E402
PHASES = ("generate", "reshard", "update", "save", "evaluate")
UNCOMPARED = ("wall_time", *MACHINE_METRIC_PREFIXES)

MARKER = "MCORE_RL_CHAOS_RUN"
CLEAN_WITHIN_SECONDS = 15
"""After a launch ends, its processes and files must be gone within this (the guards wait up to
10 s for the other ranks of a dying job to unmap a segment)."""
RESUMED = re.compile(r"resumed from step (\d+)")

PLACEMENTS = {
    "colocated": ["parallel.pipeline_model_parallel_size=2", "rollout.rollout_tp=2"],
    "split": ["placement.rollout_ranks=1", "rollout.max_staleness=0", "rollout.rollout_tp=1"],
    "split_async": ["placement.rollout_ranks=1", "rollout.max_staleness=1",
                    "rollout.rollout_tp=1"],
}
AGENTS = ("agents_split_async",)
"""Placements that run the agents example's GRPO (configs/quickstart/agents_grpo.yaml, its
random model: learning is not the point) instead of the quickstart's."""
PLACEMENTS["agents_split_async"] = PLACEMENTS["split_async"]
BITWISE = ("colocated", "split")
"""Placements whose resumed run must equal the uninterrupted one bit for bit; with rollouts
running ahead (max_staleness >= 1) which weights generated a batch depends on timing, so
there every prompt must be trained exactly once, at its step."""

_SPLIT_RANKS = {"generate": (1,), "reshard": (0, 1), "update": (0,), "save": (0,),
                "evaluate": (0,)}
RANKS_OF_PHASE = {"colocated": {phase: (0, 1) for phase in PHASES},
                  "split": _SPLIT_RANKS, "split_async": _SPLIT_RANKS,
                  "agents_split_async": _SPLIT_RANKS}
"""Where each phase runs: in split placement rank 0 trains and rank 1 generates."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare(workdir: str, agents: bool = False) -> str:
    """The quickstart's (or the agents example's) data and tiny model, converted (a random
    model: learning is not the point here). Returns its folder."""
    folder = os.path.join(workdir, "agents" if agents else "quickstart")
    python = sys.executable
    subprocess.run([python, "-m", "mcore_rl.quickstart", "prepare-agents" if agents
                    else "prepare", folder], check=True, cwd=REPO, capture_output=True)
    if not os.path.isdir(os.path.join(folder, "mcore_init")):
        subprocess.run([python, "-m", "mcore_rl", "convert", "hf-to-mcore", "--hf",
                        os.path.join(folder, "hf_init"), "--out",
                        os.path.join(folder, "mcore_init")], check=True, cwd=REPO,
                       capture_output=True)
    return folder


def job_overrides(quickstart: str, placement: str, steps: int, save_every: int,
                  eval_every: int) -> list[str]:
    return [f"init.checkpoint={quickstart}/mcore_init",
            f"data.train_files=[{quickstart}/data/rl_train.jsonl]",
            f"data.val_files=[{quickstart}/data/rl_val.jsonl]",
            f"trainer.total_steps={steps}", f"trainer.save_every={save_every}",
            f"trainer.eval_every={eval_every}", f"trainer.export_hf_every={steps}",
            "trainer.console_every=1", "trainer.plots=false", *PLACEMENTS[placement]]


def kill_schedule(seed: int, kills: int, placement: str) -> list[dict]:
    """K seeded kills, phases in turn so that every phase is hit (shuffled order)."""
    rng = random.Random(f"{seed}-{placement}")
    phases = [PHASES[index % len(PHASES)] for index in range(kills)]
    rng.shuffle(phases)
    schedule = []
    for phase in phases:
        schedule.append({"phase": phase,
                         "occurrence": rng.randint(1, 2) if phase in ("save", "evaluate")
                         else rng.randint(1, 6),
                         "rank": rng.choice(RANKS_OF_PHASE[placement][phase]),
                         "target": rng.choice(TARGETS),
                         "delay": round(rng.uniform(0, 0.05), 3)})
    return schedule


def _job_processes(marker: str) -> list[str]:
    """Command lines of live processes whose environment carries `marker`."""
    found = []
    needle = f"{MARKER}={marker}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                if needle not in handle.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                found.append(f"{name}: " + handle.read().replace(b"\0", b" ").decode()[:100])
        except OSError:
            continue
    return found


def _named_leftovers() -> set[str]:
    """Shared-memory segments and the ranks' private temporary folders on this machine."""
    return set(glob.glob("/dev/shm/*")) | set(glob.glob(os.path.join(
        system_temp_dir(), f"{TEMP_PREFIX}*")))


def _complete_steps(output_dir: str) -> list[int]:
    return sorted(int(path.split("_")[-1]) for path in
                  glob.glob(os.path.join(output_dir, "checkpoints", "step_*"))
                  if re.search(r"step_\d+$", path)
                  and os.path.isfile(os.path.join(path, "complete.json")))


def _lines(output_dir: str, name: str = "metrics.jsonl") -> list[dict]:
    path = os.path.join(output_dir, name)
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _rows(output_dir: str, name: str) -> dict[int, dict]:
    """The last row logged for each step: the one of the launch whose checkpoints the run went
    on from (a step redone after a kill is logged again)."""
    return {row["step"]: row for row in _lines(output_dir, name)}


def launch(output_dir: str, config: str, overrides: list[str], kill: dict | None,
           timeout: float) -> dict:
    """One launch of the job through scripts/torchrun.sh; what it did and left behind."""
    marker = uuid.uuid4().hex
    env = dict(os.environ, PYTHON=sys.executable, NPROC_PER_NODE="2",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1",
               **{MARKER: marker})
    env.pop(KILL_AT_VARIABLE, None)
    if kill:
        env[KILL_AT_VARIABLE] = ",".join(f"{key}={value}" for key, value in kill.items())
    before = _named_leftovers()
    complete_before = _complete_steps(output_dir)
    lines_before = len(_lines(output_dir))
    log_path = output_dir + f".launch{len(glob.glob(output_dir + '.launch*'))}.log"
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [os.path.join(REPO, "scripts", "torchrun.sh"), "train", "--config",
             config, f"runtime.output_dir={output_dir}", *overrides],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            exit_code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            exit_code = "hang"
            process.wait()
    seconds = time.monotonic() - started
    deadline = time.monotonic() + CLEAN_WITHIN_SECONDS
    while True:
        processes, left = _job_processes(marker), sorted(_named_leftovers() - before)
        if not (processes or left) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    gone_after = time.monotonic() - started - seconds
    for line in processes:  # a failed check must not leave them running
        os.kill(int(line.split(":")[0]), signal.SIGKILL)
    text = open(log_path).read()
    resumed = RESUMED.search(text)
    logged = [row["step"] for row in _lines(output_dir)[lines_before:]]
    return {"exit": exit_code, "seconds": round(seconds, 1), "log": log_path,
            "processes_left": processes, "files_left": left,
            "seconds_until_clean": round(gone_after, 1),
            "resumed_from": int(resumed.group(1)) if resumed else 0,
            "newest_complete_before": complete_before[-1] if complete_before else 0,
            "step_reached": max(logged, default=int(resumed.group(1)) if resumed else 0)}


def weights_digest(output_dir: str, step: int) -> str | None:
    folder = os.path.join(output_dir, "hf", f"step_{step:08d}")
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as handle:
            digest.update(handle.read())
    return digest.hexdigest()


def comparable(row: dict) -> dict:
    return {key: value for key, value in row.items() if not key.startswith(UNCOMPARED)}


def run_placement(workdir: str, placement: str, args) -> dict:
    agents = placement in AGENTS
    config = f"configs/quickstart/{'agents_grpo' if agents else 'grpo'}.yaml"
    overrides = job_overrides(prepare(workdir, agents), placement, args.steps, args.save_every,
                              args.eval_every)
    reference_dir = os.path.join(workdir, f"{placement}_reference")
    reference = launch(reference_dir, config, overrides, None, args.timeout)
    chaos_dir = os.path.join(workdir, f"{placement}_chaos")
    launches = []
    kills = ([parse_kill_at(text) for text in args.kill] if args.kill
             else kill_schedule(args.seed, args.kills, placement))
    for kill in kills + [None]:
        result = launch(chaos_dir, config, overrides, kill, args.timeout)
        result["kill"] = kill
        launches.append(result)
        print(_launch_line(placement, result), flush=True)
        if result["exit"] == 0:  # finished before the moment came (or no kill was left)
            break
    finished = launches[-1]
    differing, compared = [], []
    for name in ("metrics.jsonl", "eval.jsonl"):
        reference_rows, chaos_rows = (_rows(reference_dir, name), _rows(chaos_dir, name))
        compared += [f"{name}:{step}" for step in sorted(reference_rows)]
        differing += [f"{name}:{step}" for step in sorted(reference_rows)
                      if step not in chaos_rows or
                      comparable(chaos_rows[step]) != comparable(reference_rows[step])]
    reference_prompts = read_trained_prompts(reference_dir)
    return {"placement": placement, "reference": reference, "launches": launches,
            "finished": finished["exit"] == 0 and reference["exit"] == 0,
            "bitwise": placement in BITWISE,
            "weights_equal": weights_digest(chaos_dir, args.steps) is not None and
            weights_digest(chaos_dir, args.steps) == weights_digest(reference_dir, args.steps),
            "steps_compared": compared, "steps_differing": differing,
            "prompts_trained_once": len(reference_prompts) == args.steps and
            read_trained_prompts(chaos_dir) == reference_prompts}


def _launch_line(placement: str, result: dict) -> str:
    kill = result["kill"]
    what = (f"kill {kill['target']} at {kill['phase']}#{kill['occurrence']} on rank "
            f"{kill['rank']}" if kill else "no kill")
    return (f"{placement}: {what}: exit {result['exit']} after {result['seconds']} s, step "
            f"{result['step_reached']} reached (resumed from {result['resumed_from']}), "
            f"{len(result['processes_left'])} processes and {len(result['files_left'])} files "
            f"left")


def leaks(result: dict) -> int:
    """Processes and files left after any launch of the placement (the reference's too)."""
    return sum(len(launched["processes_left"]) + len(launched["files_left"])
               for launched in result["launches"] + [result["reference"]])


def kills_of(result: dict) -> list[tuple[dict, dict]]:
    """(the killed launch, the launch after it) for every kill of a placement."""
    launches = result["launches"]
    return list(zip(launches[:-1], launches[1:]))


def phase_table(results: list[dict]) -> str:
    """Kills per phase over all placements: how many, how many the run survived (the next launch
    resumed from the newest complete checkpoint and the placement's run finished), steps redone,
    and what was left behind."""
    lines = ["| phase | kills | survived | steps redone | processes + files left |",
             "|" + "---|" * 5]
    for phase in PHASES:
        rows = [(killed, after, result) for result in results
                for killed, after in kills_of(result) if killed["kill"]["phase"] == phase]
        survived = sum(after["resumed_from"] == after["newest_complete_before"]
                       and result["finished"] for _, after, result in rows)
        redone = sum(max(0, killed["step_reached"] - after["resumed_from"])
                     for killed, after, _ in rows)
        left = sum(len(killed["processes_left"]) + len(killed["files_left"])
                   for killed, _, _ in rows)
        lines.append(f"| {phase} | {len(rows)} | {survived} | {redone} | {left} |")
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    lines = ["| placement | phase | target | rank | exit | step reached | next resumed from | "
             "launch s | processes left | files left |", "|" + "---|" * 10]
    for result in results:
        for killed, after in kills_of(result):
            kill = killed["kill"]
            lines.append(f"| {result['placement']} | {kill['phase']}#{kill['occurrence']} | "
                         f"{kill['target']} | {kill['rank']} | {killed['exit']} | "
                         f"{killed['step_reached']} | {after['resumed_from']} | "
                         f"{killed['seconds']} | {len(killed['processes_left'])} | "
                         f"{len(killed['files_left'])} |")
    lines += ["", phase_table(results), ""]
    lines.append("| placement | kills | wall s (chaos / reference) | s lost per kill | "
                 "steps redone | resumes not from the newest complete checkpoint | leaks | "
                 "every prompt trained once | weights equal | metrics equal (rows compared) |")
    lines.append("|" + "---|" * 10)
    for result in results:
        launches, kills = result["launches"], len(kills_of(result))
        wall = sum(launched["seconds"] for launched in launches)
        redone = sum(max(0, killed["step_reached"] - after["resumed_from"])
                     for killed, after in kills_of(result))
        bad_resumes = sum(launched["resumed_from"] != launched["newest_complete_before"]
                          for launched in launches)
        lost = (wall - result["reference"]["seconds"]) / max(kills, 1)
        lines.append(f"| {result['placement']} | {kills} | {wall:.0f} / "
                     f"{result['reference']['seconds']:.0f} | {lost:.1f} | {redone} | "
                     f"{bad_resumes} | {leaks(result)} | {result['prompts_trained_once']} | "
                     + (f"{result['weights_equal']} | {not result['steps_differing']} "
                        f"({len(result['steps_compared'])}) |" if result["bitwise"]
                        else "not promised | not promised |"))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=10,
                        help="kills per placement (2 per phase)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--placements", default="colocated,split,split_async")
    parser.add_argument("--steps", type=int, default=24, help="trainer.total_steps")
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    parser.add_argument("--kill", action="append", default=[],
                        help="a kill of your own instead of the seeded ones (repeatable), as "
                             "MCORE_RL_KILL_AT takes it: phase=save,occurrence=1,rank=0,"
                             "target=launcher,delay=0.01")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument("--report", default=None,
                        help="only print the tables of an earlier run's results (JSON file)")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as handle:
            print(table(json.load(handle)))
        return 0
    workdir = os.path.abspath(args.workdir or os.path.join(REPO, "runs", "chaos"))
    if os.path.exists(os.path.join(workdir, "results.json")):
        parser.error(f"{workdir} holds an earlier chaos run; choose another --workdir")
    os.makedirs(workdir, exist_ok=True)
    results = [run_placement(workdir, placement, args)
               for placement in args.placements.split(",")]
    print(table(results))
    for path in (os.path.join(workdir, "results.json"), args.json):
        if path:
            with open(path, "w") as handle:
                json.dump(results, handle, indent=1)
    ok = all(result["finished"] and result["prompts_trained_once"] and not leaks(result)
             and all(launched["resumed_from"] == launched["newest_complete_before"]
                     for launched in result["launches"])
             and (not result["bitwise"] or (result["weights_equal"]
                                            and not result["steps_differing"]))
             for result in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
