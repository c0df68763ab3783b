"""One line that says what went wrong in code that is not ours (a tool, an environment, a reward
function): what a session replies, what a reward result carries, what the log shows; and which
sandbox setting would have allowed what a confined session was refused."""

import os
import re


def describe_exception(error: BaseException, limit: int = 500) -> str:
    """"ExcType: first line of the message", at most `limit` characters (one log line)."""
    lines = str(error).strip().splitlines()
    message = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return message if len(message) <= limit else message[:limit - 3] + "..."


_MEMORY = ("MemoryError", "Cannot allocate memory", "failed to map segment", "Unable to allocate",
           "bad_alloc", "out of memory")
_NETWORK = ("Network is unreachable", "Temporary failure in name resolution",
            "Name or service not known", "socket")


def setting_hint(error: str, prefix: str) -> str:
    """The sandbox setting under `prefix` (e.g. "reward") that would allow what `error`, a
    session's one-line error, says the sandbox refused, as advice; "" when none fits."""
    if any(sign in error for sign in _MEMORY) or error.startswith("session process died"):
        return f"the sandbox's address-space limit {prefix}.memory_mb may be too small"
    missing = re.fullmatch(r"KeyError: '(\w+)'", error)
    if missing and missing.group(1) in os.environ:
        return (f"the rank's environment has {missing.group(1)}, which the sandbox passes only "
                f"when {prefix}.environment names it")
    if any(sign in error for sign in _NETWORK):
        return f"the sandbox has no network unless {prefix}.network is true"
    if "PermissionError" in error or "Permission denied" in error:
        return (f"the sandbox reads only the system's folders, the Python installation, the "
                f"code's folders and {prefix}.readable, and writes only in its own folder (its "
                "working directory)")
    if error.startswith("timeout after"):
        return f"{prefix}.timeout_seconds bounds each call"
    return ""
