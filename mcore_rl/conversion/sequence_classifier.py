"""HF sequence-classification checkpoints (`LlamaForSequenceClassification` and the other
supported families' `...ForSequenceClassification`, num_labels=1) as Megatron scalar-head
models: the reward model of RLHF.

Such a checkpoint is the causal LM's trunk plus `score.weight` [1, hidden] in place of
`lm_head.weight`; the trunk maps exactly as the causal LM's does, the score row becomes the
scalar head.
"""

from __future__ import annotations

import dataclasses

import torch

from ..checkpoint.sharded_weights import split_of, stage_params_of
from ..config import ModelConfig
from ..param_layout import sharding
from ..runtime.model_rank import ModelRank
from .architectures import Architecture, architecture_for
from .hf_reader import HFCheckpoint
from .hf_to_mcore import canonical_from_hf

CLASSIFIER_SUFFIX = "ForSequenceClassification"
SCORE = "score.weight"


def open_sequence_classifier(path: str) -> tuple[HFCheckpoint, Architecture, ModelConfig]:
    """Reader, causal-LM architecture and ModelConfig of a one-label classifier folder; the
    tensors are checked before any is read."""
    hf = HFCheckpoint(path)
    name = (hf.config.get("architectures") or [""])[0]
    if not name.endswith(CLASSIFIER_SUFFIX):
        raise ValueError(f"{path}/config.json: architectures[0]={name!r} is not a "
                         f"...{CLASSIFIER_SUFFIX} (a reward model needs a scalar head)")
    causal = dict(hf.config, architectures=[name[:-len(CLASSIFIER_SUFFIX)] + "ForCausalLM"])
    arch = architecture_for(causal)
    model = arch.model_config(causal)
    if int(hf.config.get("num_labels", len(hf.config.get("id2label", {0: 0})))) != 1:
        raise ValueError(f"{path}/config.json: a reward model has num_labels=1")
    _check_tensors(hf, arch, model)
    return hf, arch, dataclasses.replace(model, tie_embeddings=False)


def _check_tensors(hf: HFCheckpoint, arch: Architecture, model: ModelConfig) -> None:
    expected = {SCORE: (1, model.hidden_size)}
    for canonical in arch.hf_to_canonical_names(model):
        if canonical != sharding.OUTPUT_LAYER:
            expected.update(arch.hf_shapes(canonical, model))
    present = set(hf.names)
    problems = [f"missing {name}" for name in sorted(set(expected) - present)]
    problems += [f"{name}: file has {hf.shape(name)}, expected {shape}"
                 for name, shape in expected.items()
                 if name in present and hf.shape(name) != shape]
    if problems:
        raise ValueError(f"HF reward model {hf.path} does not match {arch.name}'s trunk plus "
                         f"{SCORE}: " + "; ".join(problems))


def scalar_shards_from_hf(hf: HFCheckpoint, arch: Architecture, model: ModelConfig,
                          place: ModelRank) -> dict[str, torch.Tensor]:
    """The local shards at `place` of the scalar-head model, streamed tensor by tensor."""
    shards = {}
    for local, canonical in stage_params_of(place, model, "scalar").items():
        if canonical == sharding.SCALAR_HEAD:
            shards[local] = hf.tensor(SCORE).clone()
            continue
        full = canonical_from_hf(hf, arch, model, canonical)
        shards[local] = sharding.split_for_tp(canonical, full, model,
                                              *split_of(place, canonical)).clone()
    return shards


def classifier_hf_config(causal_config: dict) -> dict:
    """config.json of the one-label classifier whose trunk `causal_config` (a ...ForCausalLM
    config.json) describes: what `open_sequence_classifier` and transformers' Auto classes
    read."""
    name = causal_config["architectures"][0]
    if not name.endswith("ForCausalLM"):
        raise ValueError(f"architecture {name!r} is not a ...ForCausalLM")
    config = dict(causal_config, architectures=[name[:-len("ForCausalLM")] + CLASSIFIER_SUFFIX],
                  num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    config.pop("problem_type", None)
    return config
