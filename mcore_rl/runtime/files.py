"""Whole-file writes that a reader, a kill or a second writer never sees half-done.

A job's small text files (config.yaml, the best checkpoint's record, a data file, a bench's
results) are read by people and by later runs while the job may still be writing them: each is
written under a temporary name in the same folder and renamed over the target, which POSIX makes
atomic on one file system.
"""

from __future__ import annotations

import os


def write_text_atomically(path: str | os.PathLike, text: str) -> str:
    """Write `text` to `path` (creating its folder), through `<path>.<pid>.tmp` and a rename;
    returns the path. The temporary file is removed if the write fails."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    staging = f"{path}.{os.getpid()}.tmp"
    try:
        with open(staging, "w") as handle:
            handle.write(text)
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    return path
