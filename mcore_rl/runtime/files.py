"""Whole-file writes that a reader, a kill or a second writer never sees half-done.

A job's small text files (config.yaml, the best checkpoint's record, vLLM's config folder, a data
file, a bench's results) are read by people and by later runs, and some are written by several
ranks at once, possibly on different nodes of one shared file system: each is written under a
temporary name of its own in the same folder and renamed over the target, which POSIX makes
atomic on one file system.
"""

from __future__ import annotations

import os
import uuid


def write_text_atomically(path: str | os.PathLike, text: str) -> str:
    """Write `text` to `path` (creating its folder) through `<path>.<random>.tmp` and a rename;
    returns the path. The file gets the permissions the umask gives a new file. The temporary
    file is removed if the write fails."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    staging = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(staging, "x") as handle:
            handle.write(text)
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    return path
