"""mcore_rl weights checkpoint -> HF checkpoint folder (safetensors + config.json + tokenizer).

The output is split into safetensors files of at most `max_file_bytes`; each file's canonical
tensors are loaded from the distributed checkpoint, mapped to HF names and written, then freed,
so one process holds one output file at a time. Under torchrun the files are dealt round-robin to
the ranks (every rank joins every load, which is collective). Written to `<out>.incomplete` and
renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ..checkpoint.sharded_weights import full_tensor_request, stored_shape
from ..checkpoint.weights_io import read_metadata
from ..config import ModelConfig
from ..param_layout import sharding
from ..runtime.progress import progress
from .architectures import ARCHITECTURES, Architecture
from .sequence_classifier import SCORE, classifier_hf_config

DEFAULT_MAX_FILE_BYTES = 2 * 1024 ** 3


def plan_files(model: ModelConfig, max_file_bytes: int, bytes_per_value: int = 4,
               head: str = "lm") -> list:
    """Canonical names grouped into consecutive output files of bounded size."""
    files, current, size = [], [], 0
    for name in sharding.canonical_param_shapes(model, head):
        tensor_bytes = torch.Size(stored_shape(name, model)).numel() * bytes_per_value
        if current and size + tensor_bytes > max_file_bytes:
            files.append(current)
            current, size = [], 0
        current.append(name)
        size += tensor_bytes
    files.append(current)
    return files


def load_canonical(path: str, names: list[str], model: ModelConfig) -> dict:
    """Full canonical tensors (vocabulary padding dropped), collective over the world."""
    from megatron.core import dist_checkpointing

    request = {}
    for name in names:
        request.update(full_tensor_request(name, model))
    # Ranks read whole tensors, some the same one: no single-writer pattern to validate.
    loaded = dist_checkpointing.load(request, path, validate_access_integrity=False)
    return {name: loaded[name][: sharding.full_shape(name, model)[0]].contiguous()
            if sharding.shard_kind(name) is sharding.ShardKind.VOCAB else loaded[name]
            for name in names}


def _file_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _architecture(metadata: dict, override: str | None) -> Architecture:
    name = override or metadata.get("hf_architecture") or "LlamaForCausalLM"
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def convert_mcore_to_hf(ckpt_dir: str, out_dir: str, architecture: str | None = None,
                        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> None:
    """Collective over the current world (any number of processes). An LM checkpoint becomes
    a ...ForCausalLM folder, a scalar-head one (a reward model) a ...ForSequenceClassification
    folder with num_labels=1."""
    metadata = read_metadata(ckpt_dir)
    if os.path.exists(out_dir):
        raise FileExistsError(f"output {out_dir} already exists; refusing to overwrite it")
    model, arch, head = metadata["model"], _architecture(metadata, architecture), metadata["head"]
    files = plan_files(model, max_file_bytes, head=head)
    rank, world = dist.get_rank(), dist.get_world_size()
    staging = os.path.abspath(out_dir) + ".incomplete"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    # Rank 0's bar counts a round's files as written when its own is (the others' are similar).
    with progress(total=len(files), desc="mcore->hf", unit="file") as bar:
        for first in range(0, len(files), world):
            index = first + rank
            # Every rank joins every (collective) load; a rank without a file loads the tiny norm.
            names = files[index] if index < len(files) else [sharding.FINAL_NORM]
            canonical = load_canonical(ckpt_dir, names, model)
            if index < len(files):
                hf_tensors = {}
                for name in names:
                    hf_tensors.update(_hf_tensors(arch, name, canonical.pop(name), model))
                save_file(hf_tensors, os.path.join(staging, _file_name(index, len(files))),
                          metadata={"format": "pt"})
            bar.update(min(world, len(files) - first))
    dist.barrier()
    if rank == 0:
        weight_map = {hf_name: _file_name(index, len(files))
                      for index, names in enumerate(files) for name in names
                      for hf_name in _hf_names(arch, name, model)}
        _write_side_files(staging, ckpt_dir, metadata, arch, model, weight_map)
        os.replace(staging, os.path.abspath(out_dir))
    dist.barrier()


def _hf_tensors(arch: Architecture, name: str, tensor: torch.Tensor,
                model: ModelConfig) -> dict[str, torch.Tensor]:
    if name == sharding.SCALAR_HEAD:
        return {SCORE: tensor.contiguous()}
    return arch.from_canonical(name, tensor, model)


def _hf_names(arch: Architecture, name: str, model: ModelConfig) -> list[str]:
    return [SCORE] if name == sharding.SCALAR_HEAD else list(arch.hf_shapes(name, model))


def _write_side_files(staging: str, ckpt_dir: str, metadata: dict, arch: Architecture,
                      model: ModelConfig, weight_map: dict) -> None:
    """Index, config.json and tokenizer files (rank 0, after every weight file exists)."""
    total = sum(os.path.getsize(os.path.join(staging, file)) for file in set(weight_map.values()))
    with open(os.path.join(staging, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=2)
    with open(os.path.join(staging, "config.json"), "w") as handle:
        config = arch.hf_config(model, metadata.get("hf_config"))
        if metadata["head"] == "scalar":
            config = classifier_hf_config(config)
        json.dump(config, handle, indent=2)
    tokenizer = os.path.join(ckpt_dir, "tokenizer")
    if os.path.isdir(tokenizer):
        for name in os.listdir(tokenizer):
            shutil.copy2(os.path.join(tokenizer, name), os.path.join(staging, name))
