"""HF checkpoint -> mcore_rl weights checkpoint (Megatron distributed checkpoint), streaming.

Run single-process (the checkpoint is layout-independent, so one process can write it for any
target layout) or under torchrun with one process per target rank (tp x pp processes), each
reading only the HF tensors of its pipeline stage, one canonical tensor at a time, and keeping
only its TP shard: peak memory is about one rank's share plus the largest full tensor.

Everything that can be checked is checked before any tensor is read: the architecture, the
config fields that change the math, the layout rules, and that the HF tensors are exactly the
expected ones with the expected shapes. The output appears only when complete.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..checkpoint.sharded_weights import split_of, stage_params_of
from ..checkpoint.weights_io import save_weights
from ..config import ModelConfig
from ..param_layout import sharding
from ..runtime.layout import ParallelLayout
from ..runtime.model_rank import ModelRank
from ..runtime.progress import progress
from .architectures import Architecture, architecture_for
from .hf_reader import HFCheckpoint


def check_hf_tensors(hf: HFCheckpoint, arch: Architecture, model: ModelConfig) -> None:
    """Raise ValueError naming every missing, unexpected or mis-shaped HF tensor."""
    expected = {}
    for canonical in arch.hf_to_canonical_names(model):
        expected.update(arch.hf_shapes(canonical, model))
    present = set(hf.names)
    missing = sorted(set(expected) - present)
    extra = sorted(name for name in present - set(expected)
                   if not arch.is_redundant_hf_name(name, model))
    wrong = [f"{name}: file has {hf.shape(name)}, expected {shape}"
             for name, shape in expected.items() if name in present and hf.shape(name) != shape]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if extra:
        problems.append(f"unexpected tensors {extra}")
    if wrong:
        problems.append("mis-shaped tensors: " + "; ".join(wrong))
    if problems:
        raise ValueError(f"HF checkpoint {hf.path} does not match {arch.name} with its "
                         "config.json: " + "; ".join(problems))


def canonical_from_hf(hf: HFCheckpoint, arch: Architecture, model: ModelConfig,
                      name: str) -> torch.Tensor:
    """One canonical full tensor, read from the HF files that hold its parts."""
    sources = arch.hf_to_canonical_names(model)[name]
    return arch.to_canonical(name, {source: hf.tensor(source) for source in sources}, model)


def local_shards_from_hf(hf: HFCheckpoint, arch: Architecture, model: ModelConfig,
                         place: ModelRank) -> dict:
    """The local shards at `place` (LM head), streamed tensor by tensor. Shards are copies, so
    each full tensor is freed as soon as it has been cut."""
    shards = {}
    params = stage_params_of(place, model)
    for local, canonical in progress(params.items(), total=len(params), desc="hf->mcore",
                                     unit="tensor"):
        full = canonical_from_hf(hf, arch, model, canonical)
        shard = sharding.split_for_tp(canonical, full, model, *split_of(place, canonical))
        shards[local] = shard.clone()
        del full
    return shards


def open_hf(path: str) -> tuple[HFCheckpoint, Architecture, ModelConfig]:
    """Open and check an HF checkpoint: its reader, architecture and ModelConfig."""
    hf = HFCheckpoint(path)
    arch = architecture_for(hf.config)
    model = arch.model_config(hf.config)
    check_hf_tensors(hf, arch, model)
    return hf, arch, model


def model_config_of_hf(path: str) -> ModelConfig:
    """The ModelConfig an HF folder's config.json describes (no tensor is read)."""
    hf = HFCheckpoint(path)
    return architecture_for(hf.config).model_config(hf.config)


def tokenizer_files(hf: HFCheckpoint, arch: Architecture) -> tuple[str, ...]:
    """Paths of the tokenizer files next to the weights (they travel with the checkpoint)."""
    paths = (os.path.join(hf.path, name) for name in arch.tokenizer_files)
    return tuple(path for path in paths if os.path.isfile(path))


def convert_hf_to_mcore(hf_path: str, out_dir: str, tp: int = 1, pp: int = 1,
                        ep: int = 1, etp: int | None = None) -> ModelConfig:
    """Collective over the current world: 1 process, or exactly tp x pp x ep processes, each
    reading only the tensors of one target rank (with ep > 1, only its EP rank's experts, cut
    at expert TP etp; None: tp). The checkpoint loads at any layout either way."""
    world = dist.get_world_size()
    if world not in (1, tp * pp * ep):
        raise ValueError(f"run hf-to-mcore with 1 process or tp x pp x ep = {tp * pp * ep} "
                         f"processes, not {world}")
    if os.path.exists(out_dir):
        raise FileExistsError(f"output {out_dir} already exists; refusing to overwrite it")
    hf, arch, model = open_hf(hf_path)
    layout = ParallelLayout(tp, pp, dp=ep, ep=ep, etp=etp, order=CONVERSION_ORDER)
    errors = model.check(tp, pp, ep, etp) + layout.errors()
    if errors:
        raise ValueError(f"{hf_path} cannot be laid out at tp={tp}, pp={pp}, ep={ep}, "
                         f"etp={layout.expert_tp}: " + "; ".join(errors))
    place = ModelRank.alone() if world == 1 else ModelRank(layout, dist.get_rank())
    shards = local_shards_from_hf(hf, arch, model, place)
    save_weights(out_dir, shards, model, place, head="lm",
                 tokenizer_files=tokenizer_files(hf, arch),
                 extra_metadata={"hf_architecture": arch.name, "hf_config": hf.config,
                                 "converted_for": {"tp": tp, "pp": pp, "ep": ep,
                                                   "etp": layout.expert_tp}})
    return model


CONVERSION_ORDER = "tp-ep-dp-pp"
"""The conversion world's rank order: Megatron's default, its data-parallel ranks being as many
as the EP ranks (the DP ranks after the first, and the expert copies, are replicas that the
first writes)."""

