"""Save and load model weights as a Megatron-Core distributed checkpoint, atomically.

A weights checkpoint is a directory holding the `torch_dist` files of `dist_checkpointing`, a
`mcore_rl.json` describing the model (its ModelConfig, the head, the layout that wrote it and,
when it came from HF, the original config.json) and an optional `tokenizer/` folder. Everything
is written into `<dir>.incomplete` and renamed only after every rank finished, so an interrupted
save never leaves something that looks like a checkpoint: `is_checkpoint` checks for
`mcore_rl.json`, which is written last.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch
import torch.distributed as dist

from ..config import ModelConfig, MoEConfig, RopeScalingConfig
from ..param_layout import sharding
from ..runtime.model_rank import ModelRank
from ..runtime.process_guard import helper_processes_guarded
from .common_state import write_common_state_file
from .sharded_weights import sharded_state_dict, stage_params_of, stored_vocab_rows

METADATA_FILE = "mcore_rl.json"
FORMAT_VERSION = 1


def is_checkpoint(path: str) -> bool:
    """True for a complete weights checkpoint directory."""
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def read_metadata(path: str) -> dict:
    """The checkpoint's metadata, with `model` as a ModelConfig."""
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path} is not an mcore_rl checkpoint (no {METADATA_FILE}; an "
                                "interrupted save leaves only '<dir>.incomplete')")
    with open(os.path.join(path, METADATA_FILE)) as handle:
        metadata = json.load(handle)
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}/{METADATA_FILE}: format_version "
                         f"{metadata.get('format_version')} is not {FORMAT_VERSION}")
    metadata["model"] = model_config_from_dict(metadata["model"])
    return metadata


def model_config_from_dict(values: dict) -> ModelConfig:
    """Inverse of dataclasses.asdict for ModelConfig."""
    values = dict(values)
    if values.get("rope_scaling") is not None:
        values["rope_scaling"] = RopeScalingConfig(**values["rope_scaling"])
    if "moe" in values:  # checkpoints from before MoE have none: dense
        moe = dict(values["moe"])
        values["moe"] = MoEConfig(**{**moe, "dense_layers": tuple(moe["dense_layers"])})
    return ModelConfig(**values)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_weights(path: str, local_shards: dict, model: ModelConfig, place: ModelRank,
                 head: str = "lm", extra_metadata: dict | None = None,
                 tokenizer_files: tuple[str, ...] = (), overwrite: bool = False) -> None:
    """Collective: every rank passes its local shards; the checkpoint appears at `path` only when
    complete, with `tokenizer_files` copied into its tokenizer/ folder. Refuses an existing
    `path` unless `overwrite`."""
    from megatron.core import dist_checkpointing

    final = os.path.abspath(path)
    staging = final + ".incomplete"
    if os.path.exists(final) and not overwrite:
        raise FileExistsError(f"{final} already exists; refusing to overwrite it")
    if _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    _barrier()
    state = sharded_state_dict(local_shards, model, place, head)
    with helper_processes_guarded():  # the torch_dist writer's Manager, started by the first save
        dist_checkpointing.save(state, staging)
    _barrier()
    if _rank() == 0:
        write_common_state_file(staging)
        if tokenizer_files:
            os.makedirs(os.path.join(staging, "tokenizer"))
            for file in tokenizer_files:
                shutil.copy2(file, os.path.join(staging, "tokenizer"))
        metadata = dict(extra_metadata or {}, format_version=FORMAT_VERSION, head=head,
                        model=dataclasses.asdict(model),
                        saved_layout=_saved_layout(place))
        with open(os.path.join(staging, METADATA_FILE), "w") as handle:
            json.dump(metadata, handle, indent=2)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(staging, final)
    _barrier()


def _saved_layout(place: ModelRank) -> dict:
    """The layout that wrote a checkpoint (informative: it loads at any layout)."""
    layout = {"tp": place.tp_size, "pp": place.pp_size}
    if place.ep_size > 1:
        layout["ep"] = place.ep_size
    if place.etp_size != place.tp_size:
        layout["etp"] = place.etp_size
    return layout


def _check_same_model(path: str, stored: ModelConfig, model: ModelConfig) -> None:
    stored_fields, wanted = dataclasses.asdict(stored), dataclasses.asdict(model)
    differing = [f"{key}: checkpoint {stored_fields[key]!r}, model {wanted[key]!r}"
                 for key in wanted if stored_fields[key] != wanted[key]]
    if differing:
        raise ValueError(f"{path} holds a different model: " + "; ".join(differing))


@torch.no_grad()
def load_weights_into(path: str, local_shards: dict, model: ModelConfig,
                      place: ModelRank, head: str = "lm") -> None:
    """Collective: fill each rank's local shards (tensors, e.g. a model stage's parameters) in
    place from the checkpoint, whatever layout wrote it."""
    from megatron.core import dist_checkpointing

    metadata = read_metadata(path)
    _check_same_model(path, metadata["model"], model)
    if metadata["head"] != head:
        raise ValueError(f"{path} holds a model with a '{metadata['head']}' head, not '{head}'")
    targets = {name: torch.empty_like(tensor, device="cpu") for name, tensor in
               local_shards.items()}
    state = sharded_state_dict(targets, model, place, head)
    loaded = dist_checkpointing.load(state, path)
    for key, piece in state.items():
        piece.data.copy_(loaded[key])
    _zero_vocab_padding(targets, model, place, head)
    for name, tensor in local_shards.items():
        tensor.copy_(targets[name])


def _zero_vocab_padding(targets: dict, model: ModelConfig, place: ModelRank,
                        head: str) -> None:
    """Zero the vocabulary rows that only exist as padding for this TP size (not stored)."""
    sources = stage_params_of(place, model, head)
    for name, tensor in targets.items():
        if sharding.shard_kind(sources[name]) is not sharding.ShardKind.VOCAB:
            continue
        rows = tensor.shape[0]
        first_padding = stored_vocab_rows(model) - place.tp_rank * rows
        if first_padding < rows:
            tensor[max(first_padding, 0):] = 0
