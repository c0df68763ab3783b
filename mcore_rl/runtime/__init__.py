"""Process start-up, Megatron parallel state, seeding, and the CPU compatibility layer."""

from .distributed import Runtime, initialize, seed_everything, shutdown, start_process_group
from .launch_env import LaunchEnv, read_launch_env
from .log import is_rank0, peak_resident_mb, print0, quiet_known_warnings

__all__ = ["LaunchEnv", "Runtime", "initialize", "is_rank0", "peak_resident_mb", "print0",
           "quiet_known_warnings",
           "read_launch_env", "seed_everything", "shutdown", "start_process_group"]
