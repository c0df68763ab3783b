"""Give a freshly built model stage its starting weights from `config.init`.

An HF folder is read directly (each rank streams only its stage's tensors and keeps its TP
shards); an mcore_rl checkpoint loads through Megatron's distributed checkpointing at whatever
layout wrote it. A scalar-head model (critic, reward model) started from an LM checkpoint takes
the transformer trunk and keeps its freshly initialised head.
"""

from __future__ import annotations

import torch

from ..checkpoint.sharded_weights import stage_params_of
from ..checkpoint.weights_io import load_weights_into, read_metadata
from ..config import InitConfig, ModelConfig, ParallelConfig
from ..config.lora import LoraConfig
from ..param_layout import sharding
from ..runtime.devices import collective_device
from ..runtime.model_rank import ModelRank
from .build import build_gpt_model
from .weights import base_parameters, copy_into_stage, model_rank_of


def build_from_init(init: InitConfig, model: ModelConfig, parallel: ParallelConfig,
                    precision: str, head: str = "lm", device: torch.device | None = None,
                    lora: LoraConfig | None = None, seed: int = 0, *, place: ModelRank):
    """The model stage at `place` holding `init`'s weights, randomly initialised only when
    `init` names no weights (initialising what a checkpoint overwrites costs minutes at scale);
    with lora enabled, `init`'s weights are the frozen base of new adapters started from
    `seed`."""
    module = build_gpt_model(model, parallel, precision, head, device,
                             random_init=not (init.hf_path or init.checkpoint), lora=lora,
                             seed=seed, place=place)
    load_initial_weights(module, init, model, head)
    check_replicas_identical(module)
    return module


def build_frozen_from_init(init: InitConfig, model: ModelConfig, parallel: ParallelConfig,
                           precision: str, place: ModelRank,
                           device: torch.device | None = None):
    """The stage at `place` of a frozen LM (no gradients) in its own layout (which `parallel`
    describes), holding `init`'s weights: a teacher beside the trained model."""
    module = build_gpt_model(model, parallel, precision, "lm", device, random_init=False,
                             place=place)
    if not load_initial_weights(module, init, model, "lm"):
        raise ValueError("a frozen model needs weights: set hf_path or checkpoint")
    for param in module.parameters():
        param.requires_grad_(False)
    return module


@torch.no_grad()
def copy_of_stage(module: torch.nn.Module, model: ModelConfig, parallel: ParallelConfig,
                  precision: str, device: torch.device | None = None) -> torch.nn.Module:
    """A second LM stage holding `module`'s current weights (a copy, not a second load, so a
    randomly initialised policy gets the same copy): a reference's starting policy."""
    copy = build_gpt_model(model, parallel, precision, "lm", device, random_init=False,
                           place=model_rank_of(module))
    copy_into_stage(copy, {name: param.detach() for name, param in
                           base_parameters(module).items()})
    return copy


@torch.no_grad()
def check_replicas_identical(module: torch.nn.Module) -> None:
    """Raise on every rank when the data-parallel replicas of this stage differ: gradients
    are averaged over DP, so replicas that start apart (an RNG seeded differently on one
    rank, a partial load) would train different models without any error. A Mixture-of-Experts
    model's experts are compared over their own replicas (Megatron's expert data-parallel
    group): the DP ranks of different EP ranks hold different experts."""
    expert = [param for param in module.parameters() if not getattr(param, "allreduce", True)]
    dense = [param for param in module.parameters() if getattr(param, "allreduce", True)]
    here = model_rank_of(module)
    differ = _replicas_differ(dense, here.group("dp"))
    if expert:
        differ |= _replicas_differ(expert, here.group("edp"))
    if differ:
        raise RuntimeError("the data-parallel replicas of the model start from different "
                           "weights (seeding or loading differs between ranks)")


def _replicas_differ(params: list[torch.Tensor], group) -> bool:
    """Whether `params` (sums and sums of squares) differ between the ranks of `group`."""
    import torch.distributed as dist

    if dist.get_world_size(group) == 1 or not params:
        return False
    device = collective_device(group)
    digest = torch.stack([statistic for param in params
                          for statistic in (param.double().sum(), param.double().square().sum())])
    low, high = digest.to(device), digest.to(device).clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    return not torch.equal(low, high)


@torch.no_grad()
def load_initial_weights(module: torch.nn.Module, init: InitConfig, model: ModelConfig,
                         head: str = "lm") -> bool:
    """Load `init`'s weights into the stage (at the place it carries); False when init names no
    source."""
    place = model_rank_of(module)
    if init.hf_path:
        from ..conversion.hf_to_mcore import local_shards_from_hf, open_hf

        hf, arch, hf_model = open_hf(init.hf_path)
        shards = local_shards_from_hf(hf, arch, hf_model, place)
        copy_into_stage(module, _for_head(shards, head), keep=_kept(head))
        return True
    if init.checkpoint:
        stored_head = read_metadata(init.checkpoint)["head"]
        params = {name: p.data for name, p in base_parameters(module).items()}
        if stored_head == head:
            load_weights_into(init.checkpoint, params, model, place, head)
            return True
        if stored_head != "lm":
            raise ValueError(f"{init.checkpoint} holds a '{stored_head}' head: a '{head}' model "
                             f"starts from an LM checkpoint or a '{head}' one")
        trunk = {name: p for name, p in params.items() if name not in _kept(head)}
        stored = dict(trunk)
        if stored_head == "lm" and sharding.OUTPUT_LAYER in stage_params_of(place, model, "lm"):
            stored[sharding.OUTPUT_LAYER] = torch.empty(
                sharding.local_shape(sharding.OUTPUT_LAYER, model, place.tp_size))
        load_weights_into(init.checkpoint, stored, model, place, stored_head)
        return True
    return False


def _kept(head: str) -> tuple[str, ...]:
    """Parameters an LM checkpoint cannot provide for this head."""
    return (sharding.SCALAR_HEAD,) if head == "scalar" else ()


def _for_head(lm_shards: dict, head: str) -> dict:
    """An LM stage's shards restricted to what a `head` model holds."""
    if head == "lm":
        return lm_shards
    return {name: tensor for name, tensor in lm_shards.items() if name != sharding.OUTPUT_LAYER}

