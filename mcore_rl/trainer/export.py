"""The actor as an HF folder during training (trainer.export_hf_every).

Users deploy and evaluate HF folders, so a run can leave one next to its checkpoints. The export
reuses the two tested halves of conversion: the actor's shards are written as an mcore_rl
weights checkpoint (every rank its own shards), which `convert_mcore_to_hf` then turns into
safetensors + config.json + tokenizer, collectively, staged and renamed when complete. The
intermediate checkpoint is deleted afterwards.
"""

from __future__ import annotations

import json
import os
import shutil

import torch.distributed as dist

from mcore_rl.checkpoint.weights_io import megatron_coordinates, save_weights
from mcore_rl.config import JobConfig
from mcore_rl.conversion.mcore_to_hf import convert_mcore_to_hf
from mcore_rl.models.weights import local_parameters

from .build import hf_architecture


def export_actor_to_hf(config: JobConfig, module, tokenizer, out_dir: str) -> str:
    """Write this rank's actor stage `module` into the HF folder `out_dir` (collective). An
    existing folder is replaced: it is from a run that died after exporting this step and
    before checkpointing it, and the resumed run has just trained the step again."""
    if dist.get_rank() == 0 and os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    dist.barrier()
    architecture = hf_architecture(config)
    weights_dir = out_dir + ".mcore"
    save_weights(weights_dir, local_parameters(module), config.model, megatron_coordinates(),
                 extra_metadata={"hf_architecture": architecture.name,
                                 "hf_config": _initial_hf_config(config)},
                 tokenizer_files=_tokenizer_files(tokenizer), overwrite=True)
    convert_mcore_to_hf(weights_dir, out_dir, architecture.name)
    if dist.get_rank() == 0:
        shutil.rmtree(weights_dir)
    dist.barrier()
    return out_dir


def _initial_hf_config(config: JobConfig) -> dict | None:
    """The starting HF folder's config.json (kept fields such as token ids), if any."""
    if not config.init.hf_path:
        return None
    with open(os.path.join(config.init.hf_path, "config.json")) as handle:
        return json.load(handle)


TOKENIZER_FILES = ("special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")


def _tokenizer_files(tokenizer) -> tuple[str, ...]:
    """The tokenizer's files in its folder (which may be the initial model's, so weights and
    config.json are left out)."""
    folder = getattr(tokenizer, "name_or_path", "")
    if not os.path.isdir(folder):
        return ()
    return tuple(os.path.join(folder, name) for name in sorted(os.listdir(folder))
                 if name.startswith("tokenizer") or name in TOKENIZER_FILES
                 or name.endswith(".model"))
