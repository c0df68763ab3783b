"""HF export of a job's model: the actor as an HF folder during training
(trainer.export_hf_every), and the metadata every saved checkpoint keeps for the way back.

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

from mcore_rl.checkpoint.weights_io import read_metadata, save_weights
from mcore_rl.config import JobConfig
from mcore_rl.runtime.model_rank import ModelRank

from .architectures import ARCHITECTURES, Architecture, architecture_for
from .mcore_to_hf import convert_mcore_to_hf


def export_actor_to_hf(config: JobConfig, parameters: dict, place: ModelRank, tokenizer,
                       out_dir: str) -> str:
    """Write the actor shards at `place` (`parameters`: Megatron local names -> tensors) into the
    HF folder `out_dir` (collective). An existing folder is replaced: it is from a run that
    died after exporting this step and before checkpointing it, and the resumed run has just
    trained the step again."""
    if dist.get_rank() == 0 and os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    dist.barrier()
    metadata = hf_metadata(config)
    weights_dir = out_dir + ".mcore"
    save_weights(weights_dir, parameters, config.model, place,
                 extra_metadata=metadata, tokenizer_files=tokenizer_files(tokenizer),
                 overwrite=True)
    convert_mcore_to_hf(weights_dir, out_dir, metadata["hf_architecture"])
    if dist.get_rank() == 0:
        shutil.rmtree(weights_dir)
    dist.barrier()
    return out_dir


def hf_architecture(config: JobConfig) -> Architecture:
    """The HF architecture the engine loads: the init checkpoint's, else Llama's (Qwen3-MoE's
    for a Mixture-of-Experts model, Qwen2-MoE's when it has a shared expert)."""
    if config.init.hf_path:
        with open(os.path.join(config.init.hf_path, "config.json")) as handle:
            return architecture_for(json.load(handle))
    if config.init.checkpoint:
        from mcore_rl.checkpoint import read_metadata
        name = read_metadata(config.init.checkpoint).get("hf_architecture")
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    moe = config.model.moe
    if moe.enabled:
        return ARCHITECTURES["Qwen2MoeForCausalLM" if moe.shared_expert_ffn_hidden_size
                             else "Qwen3MoeForCausalLM"]
    return ARCHITECTURES["LlamaForCausalLM"]


def hf_metadata(config: JobConfig) -> dict:
    """What a weights checkpoint of this model keeps for the way back to HF: the architecture
    and the starting model's config.json (fields such as token ids), from init.hf_path or the
    init checkpoint."""
    hf_config = None
    if config.init.hf_path:
        with open(os.path.join(config.init.hf_path, "config.json")) as handle:
            hf_config = json.load(handle)
    elif config.init.checkpoint:
        hf_config = read_metadata(config.init.checkpoint).get("hf_config")
    return {"hf_architecture": hf_architecture(config).name, "hf_config": hf_config}


TOKENIZER_FILES = ("special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")


def tokenizer_files(tokenizer) -> tuple[str, ...]:
    """The tokenizer's files in its folder (which may be the initial model's, so weights and
    config.json are left out)."""
    folder = getattr(tokenizer, "name_or_path", "")
    if not os.path.isdir(folder):
        return ()
    return tuple(os.path.join(folder, name) for name in sorted(os.listdir(folder))
                 if name.startswith("tokenizer") or name in TOKENIZER_FILES
                 or name.endswith(".model"))
