"""Deliberate kills at named points of a run, for the chaos test (bench/chaos.py).

A run survives a kill only if every phase can be interrupted: generation, weight sync, the
update, a checkpoint half-written, an evaluation. Killing from outside at a random moment
mostly lands in whatever phase is longest, so the chaos test instead names the moment:

    MCORE_RL_KILL_AT="phase=save,occurrence=2,rank=0,target=launcher,delay=0.05"

When rank `rank` enters `phase` (a PhaseTimer phase: generate, reshard, switch, reward,
logprobs, update, ...; or "save", "evaluate") for the `occurrence`-th time, it sends SIGKILL,
after `delay` seconds (from a timer thread, so the phase goes on meanwhile), to `target`:
"rank" (itself), "launcher" (its parent, torchrun's agent) or "group" (the launcher's whole
process group). The kill is a real `kill -9`; nothing is cleaned up first. Unset (every
real run), `kill_point` only counts.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from .log import job_rank

KILL_AT_VARIABLE = "MCORE_RL_KILL_AT"
TARGETS = ("rank", "launcher", "group")

_entered: dict[str, int] = {}


def parse_kill_at(text: str) -> dict:
    """The fields of a MCORE_RL_KILL_AT value (raises ValueError naming what is wrong)."""
    fields = dict(item.split("=", 1) for item in text.split(",") if "=" in item)
    unknown = set(fields) - {"phase", "occurrence", "rank", "target", "delay"}
    if unknown or "phase" not in fields:
        raise ValueError(f"{KILL_AT_VARIABLE}={text!r}: expected phase=NAME[,occurrence=N]"
                         f"[,rank=R][,target={'|'.join(TARGETS)}][,delay=SECONDS]")
    kill = {"phase": fields["phase"], "occurrence": int(fields.get("occurrence", 1)),
            "rank": int(fields.get("rank", 0)), "target": fields.get("target", "rank"),
            "delay": float(fields.get("delay", 0))}
    if kill["target"] not in TARGETS:
        raise ValueError(f"{KILL_AT_VARIABLE}: target={kill['target']!r} is not one of "
                         f"{', '.join(TARGETS)}")
    return kill


def kill_point(phase: str) -> None:
    """Count an entry into `phase`; kill as MCORE_RL_KILL_AT says when this is its moment."""
    _entered[phase] = _entered.get(phase, 0) + 1
    text = os.environ.get(KILL_AT_VARIABLE)
    if not text:
        return
    kill = parse_kill_at(text)
    if (kill["phase"], kill["occurrence"]) != (phase, _entered[phase]) or \
            kill["rank"] != job_rank():
        return
    if kill["delay"] > 0:
        threading.Timer(kill["delay"], _kill, (kill["target"],)).start()
    else:
        _kill(kill["target"])


def _kill(target: str) -> None:
    if target == "rank":
        os.kill(os.getpid(), signal.SIGKILL)
    elif target == "launcher":
        os.kill(os.getppid(), signal.SIGKILL)
    else:
        os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
    time.sleep(60)  # the launcher's death ends this rank (exit_with_launcher)
