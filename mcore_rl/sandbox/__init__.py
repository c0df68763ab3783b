"""Sandboxed sessions for what the model's text reaches: one confined process per session.

In agentic RL the model's output becomes input to code - tool arguments, Python it wrote - and a
user's environment runs next to it; a reward function parses it too (rewards/worker_pool.py).
That code may hang, allocate or fork without bound, read or write wherever the trainer may, or
open connections; none of it may stop training or reach the machine. So it runs in processes
the kernel confines. Python-level guards (audit hooks) are no boundary - ctypes walks around
them - and none is used.

One process per session: an environment is a user object holding an episode's state, so a
session's requests run where that object lives, one at a time, and a hang or a crash costs only
its own session (killed; the others go on). A rank keeps many sessions open (one per episode, e.g.
128), mostly idle. The rank has threads (torch, NCCL, vLLM), so it must not fork, and a fresh
interpreter per session costs ~100 times a fork. So the rank starts one "zygote" process once,
which confines itself and then forks each session (~1-2 ms). The zygote is started with
subprocess, not multiprocessing's spawn: spawn re-imports the trainer's `__main__` (torch
included) into the child, and so into every session's address space, which RLIMIT_AS counts.

What holds where a mechanism is missing: `Sandbox.mechanisms()`.

One concern a file, imported one way only (client -> launch -> zygote -> zygote_confinement ->
session -> interpreter -> kernel, channel, limits, errors, user_code):
- limits.py: SandboxLimits, what one session may use;
- kernel.py: prctl, capabilities, user namespaces, Landlock and seccomp through ctypes;
- channel.py: the rank's non-blocking end of a session's socket, plain-data unpickling;
- session.py: a forked session's confinement and request loop;
- interpreter.py: a fresh interpreter a session can exec (the python tool's), in a Landlock
  domain of its own that reads neither `readable` nor the user's code;
- zygote.py: the zygote's entry point, fork loop and reaping;
- zygote_confinement.py: the zygote confining itself once, before its first fork;
- user_code.py: the user's code in a session as Python would load it (the script's objects by
  value, the code's folders readable);
- client.py: the rank's side, Sandbox and its Replies;
- launch.py: the rank starting its zygote process and stopping it (also from a finalizer);
- errors.py: an exception in one line, as sessions reply it.

Nothing here imports torch or mcore_rl.runtime at module level: the zygote imports this package
(ZYGOTE_BOOT imports `zygote_main` from here), and every session's address space holds what the
zygote imported.

Reused by the python tool (python_tool.py): `set_parent_death_signal`, `describe_status`,
`fresh_interpreter`, `confine_interpreter`, `BASIC_ENVIRONMENT`.
"""

from .client import Reply, Sandbox
from .interpreter import confine_interpreter, fresh_interpreter
from .kernel import describe_status, set_parent_death_signal
from .limits import BASIC_ENVIRONMENT, SandboxLimits
from .zygote import zygote_main

__all__ = ["BASIC_ENVIRONMENT", "Reply", "Sandbox", "SandboxLimits", "confine_interpreter",
           "describe_status", "fresh_interpreter", "set_parent_death_signal", "zygote_main"]
