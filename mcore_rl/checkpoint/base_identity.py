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
from ..config.lora import LoraConfig

SAMPLE_BYTES = 1 << 20


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".distcp", ".gguf")
CONFIG_NAMES = ("config.json", "mcore_rl.json", "metadata.json")


def base_identity(init: InitConfig, seed: int, lora: LoraConfig) -> dict:
    """{"source", "fingerprint", "adapters"} of the starting weights `init` names (a random
    start is identified by its seed) and of the adapters trained on them (rank, alpha,
    targets: a resume with other settings would scale or drop the saved adapters)."""
    source = init.hf_path or init.checkpoint
    adapters = (f"rank {lora.rank}, alpha {lora.alpha:g}, "
                f"targets {', '.join(lora.megatron_targets())}")
    if source is None:
        return {"source": None, "fingerprint": f"random init, seed {seed}", "adapters": adapters}
    return {"source": os.path.abspath(source), "fingerprint": folder_fingerprint(source),
            "adapters": adapters}


def folder_fingerprint(folder: str) -> str:
    """sha256 over the weight and config files' relative paths, sizes, first and last MiB
    (READMEs, caches and hidden folders left out: a re-download must not look like another
    base)."""
    digest = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(folder)):
        dirs[:] = sorted(name for name in dirs if not name.startswith("."))
        for name in sorted(files):
            if not (name.endswith(WEIGHT_SUFFIXES) or name in CONFIG_NAMES
                    or name.endswith(".index.json")):
                continue
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            digest.update(f"{os.path.relpath(path, folder)}:{size}\n".encode())
            with open(path, "rb") as handle:
                digest.update(handle.read(SAMPLE_BYTES))
                if size > 2 * SAMPLE_BYTES:
                    handle.seek(size - SAMPLE_BYTES)
                    digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()
