"""Move weights between a built model stage and the canonical full layout (parallel/sharding.py).

`load_full_state` is how every model gets real weights: from an HF conversion, a merged
checkpoint, or a test's reference tensors. It refuses a state that does not cover exactly the
parameters this stage holds, naming the missing or unexpected ones, before copying anything.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..config import ModelConfig
from ..config.lora import LoraConfig
from ..param_layout import sharding
from ..runtime.model_rank import ModelRank


def local_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """This stage's parameters under local-spec names (Transformer Engine names mapped)."""
    return {sharding.canonical_name(name): param for name, param in module.named_parameters()}


def base_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """`local_parameters` without adapter matrices: what a model checkpoint or an HF folder
    holds."""
    return {name: param for name, param in local_parameters(module).items()
            if sharding.adapter_of(name) is None}


def local_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of this stage's parameters, under local-spec names."""
    return {name: param.detach().cpu().clone() for name, param in local_parameters(module).items()}


@torch.no_grad()
def copy_into_stage(module: torch.nn.Module, local_shards: Mapping[str, torch.Tensor],
                    keep: tuple[str, ...] = ()) -> None:
    """Copy local shards (local-spec names) into the stage's parameters, in place, after
    checking that they cover exactly the parameters, except those in `keep` and adapters (left
    as they are), with the right shapes."""
    params = {name: p for name, p in base_parameters(module).items() if name not in keep}
    missing = sorted(set(params) - set(local_shards))
    unexpected = sorted(set(local_shards) - set(params))
    if missing or unexpected:
        raise ValueError(f"weights do not match the model stage: model parameters without a "
                         f"tensor {missing}, tensors without a parameter {unexpected}")
    for name, param in params.items():
        if tuple(param.shape) != tuple(local_shards[name].shape):
            raise ValueError(f"tensor '{name}' has shape {tuple(local_shards[name].shape)}, "
                             f"the model stage expects {tuple(param.shape)}")
    for name, param in params.items():
        param.copy_(local_shards[name])


def load_full_state(module: torch.nn.Module, full_state: Mapping[str, torch.Tensor],
                    model: ModelConfig, head: str = "lm") -> None:
    """Copy the stage's shards (at the place it carries) of a canonical full state into it, in
    place."""
    here = model_rank_of(module)
    shards = sharding.shard_full_state(
        full_state, model, here.tp_size, here.pp_size, here.tp_rank, here.pp_rank, head,
        here.ep_size, here.ep_rank, (here.etp_size, here.etp_rank))
    copy_into_stage(module, shards)


def model_rank_of(module: torch.nn.Module) -> ModelRank:
    """The `ModelRank` a stage built by `build_gpt_model` carries (through DDP and precision
    wrappers)."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(module).model_rank


def adapter_config_of(module: torch.nn.Module) -> LoraConfig | None:
    """The adapters' settings a stage built by `build_gpt_model` carries (None: no adapters)."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(module).adapter_config
