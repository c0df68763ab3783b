"""What one session may use: SandboxLimits.

A module of its own because every process of the sandbox reads it: the rank sets it, and the
zygote and each session get it in the zygote's pickled setup, which names this class.
"""

from __future__ import annotations

from dataclasses import dataclass

BASIC_ENVIRONMENT = ("PATH", "LANG", "LC_ALL", "TZ", "OMP_NUM_THREADS", "LD_LIBRARY_PATH")
"""What every session sees of the rank's environment (HOME and TMPDIR are its directory).
LD_LIBRARY_PATH: a cluster's Python (an Lmod module) may find libpython only through it, and
the zygote is that Python."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one session may use."""

    timeout_seconds: float = 30.0
    """Wall clock per call (open or request); past it the session process is killed."""

    memory_mb: int = 1024
    """RLIMIT_AS of a session process (its address space, the forked interpreter included)."""

    cpu_seconds: float = 30.0
    """CPU seconds per call: RLIMIT_CPU's soft limit is set before each call to the CPU time used
    so far plus this (SIGXCPU ends the session). A soft limit the handler's code could raise
    again; the wall clock bounds every call regardless."""

    max_processes: int = 16
    """Processes a session may have running besides itself (RLIMIT_NPROC)."""

    max_file_mb: int = 64
    """Largest file a session may write (RLIMIT_FSIZE)."""

    network: bool = False
    """False: no network (a network namespace of its own; Landlock's TCP rules where user
    namespaces are blocked)."""

    environment: tuple[str, ...] = ()
    """Variables of the rank's environment the sessions see besides BASIC_ENVIRONMENT; none
    else (the rank's holds tokens and credentials: W&B, HF, cloud)."""

    readable: tuple[str, ...] = ()
    """Folders and files sessions may read besides the system's folders (/usr, /lib, /etc,
    /dev, /proc, /sys), the Python installation, the code on the import path and their own
    directory (Landlock). The session's own code only: the python tool's interpreter reads
    none of them, nor the code (interpreter.py)."""

    allow_unconfined: bool = False
    """Whether the sandbox may run where Landlock does not work (an old kernel, a container that
    filters the landlock_* calls): sessions then read and write whatever their user may (file
    permissions only; network and process limits still hold), the rank logs so once and
    `mechanisms()` reports filesystem "unconfined". False: the sandbox refuses to start there,
    since nothing else keeps model-written code from the machine's files."""

    def __post_init__(self):
        for name in ("timeout_seconds", "memory_mb", "cpu_seconds", "max_file_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, not "
                                 f"{getattr(self, name)}")
        if self.max_processes < 0:
            raise ValueError("SandboxLimits.max_processes must be 0 or more, not "
                             f"{self.max_processes}")
