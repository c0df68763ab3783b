"""What identifies the frozen base a set of adapters was trained on.

An adapter checkpoint holds the adapters only; the base comes from `init` when the run resumes.
Adapters loaded onto another base give a different model without any error, so the checkpoint
records the base and a resume compares. A fingerprint of the files (names, sizes, and the first
and last MiB of each) tells two bases apart in seconds even at 70B, where hashing every byte
would take minutes; it does not catch an edit in the middle of a file that keeps its size.
"""

from __future__ import annotations

import hashlib
import os

from ..config import InitConfig

SAMPLE_BYTES = 1 << 20


def base_identity(init: InitConfig, seed: int) -> dict:
    """{"source", "fingerprint"} of the starting weights `init` names; a random start is
    identified by its seed."""
    source = init.hf_path or init.checkpoint
    if source is None:
        return {"source": None, "fingerprint": f"random init, seed {seed}"}
    return {"source": os.path.abspath(source), "fingerprint": folder_fingerprint(source)}


def folder_fingerprint(folder: str) -> str:
    """sha256 over every file's relative path, size, first and last MiB."""
    digest = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(folder)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            digest.update(f"{os.path.relpath(path, folder)}:{size}\n".encode())
            with open(path, "rb") as handle:
                digest.update(handle.read(SAMPLE_BYTES))
                if size > 2 * SAMPLE_BYTES:
                    handle.seek(size - SAMPLE_BYTES)
                    digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()
