"""Process start-up, Megatron parallel state, seeding, and the CPU compatibility layer.

The names below are resolved on first use: a rank imports `runtime.process_guard` before
anything heavy (to arm its launcher-death signal within a moment of starting), and that must not
pull torch in through this package.
"""

import importlib

_OWNERS = {"Runtime": "distributed", "initialize": "distributed",
           "seed_everything": "distributed", "shutdown": "distributed",
           "start_process_group": "distributed", "LaunchEnv": "launch_env",
           "read_launch_env": "launch_env", "is_rank0": "log", "peak_resident_mb": "log",
           "print0": "log", "quiet_known_warnings": "log"}
"""Each exported name: the module that defines it."""

__all__ = sorted(_OWNERS)


def __getattr__(name: str):
    if name in _OWNERS:
        return getattr(importlib.import_module(f".{_OWNERS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
