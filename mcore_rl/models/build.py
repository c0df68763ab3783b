"""Build this rank's stage of a Llama-family Megatron-Core GPTModel, with an LM or scalar head.

Parameters are created on the rank's GPU (on the CPU without one), with Megatron's own
initialisers only when no checkpoint will overwrite them (`random_init`).
"""

from __future__ import annotations

from typing import Literal

import torch

from ..config import ModelConfig, ParallelConfig
from ..config.lora import LoraConfig
from ..param_layout.sharding import adapter_of
from ..runtime.log import print0
from ..runtime.model_rank import ModelRank
from .heads import ScalarHead
from .layer_spec import decoder_spec
from .lora import initialize_adapters
from .rope import llama3_scaled_frequencies, rope_inverse_frequencies
from .transformer_config import megatron_transformer_config

Head = Literal["lm", "scalar"]


def build_gpt_model(model: ModelConfig, parallel: ParallelConfig, precision: str = "fp32",
                    head: Head = "lm", device: torch.device | None = None,
                    random_init: bool = True, lora: LoraConfig | None = None,
                    seed: int = 0, *, place: ModelRank):
    """The GPTModel stage the rank at `place` holds (the layout `parallel` describes), built
    over `place`'s process groups. The stage carries `place` (`model_rank_of`) and its adapters'
    settings (`adapter_config_of`).

    head="lm": vocab-parallel logits over `model.padded_vocab_size(tp)` rows.
    head="scalar": one number per position (critic values, reward-model scores).
    random_init=False: parameters are left uninitialised for the caller to load (the scalar
    head still starts at zero).
    lora (enabled): the targeted linears get adapters, started from `seed` (models/lora.py);
    everything else is frozen, except a scalar head, which trains whole.
    """
    from megatron.core.models.gpt import GPTModel

    if head not in ("lm", "scalar"):
        raise ValueError(f"head={head!r} must be 'lm' or 'scalar'")
    if lora is not None:
        _check_lora_targets(lora, model)
    config = megatron_transformer_config(model, parallel, precision, random_init)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(config, model.qk_norm, model.moe.enabled,
                                            place.pp_rank, lora),
        vocab_size=model.padded_vocab_size(parallel.tensor_model_parallel_size),
        max_sequence_length=model.max_position_embeddings,
        pre_process=place.is_first_stage,
        post_process=place.is_last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_embeddings and head == "lm",
        position_embedding_type="rope",
        rotary_base=model.rope_theta,
        pg_collection=place.groups,
    )
    gpt.model_rank = place
    gpt.adapter_config = lora if lora is not None and lora.enabled else None
    if model.rope_scaling is not None:
        inv_freq = rope_inverse_frequencies(model.kv_channels, model.rope_theta)
        gpt.rotary_pos_emb.inv_freq = llama3_scaled_frequencies(inv_freq, model.rope_scaling)
    if head == "scalar" and place.is_last_stage:
        gpt.output_layer = ScalarHead(model.hidden_size, config.params_dtype,
                                      parallel.sequence_parallel, device)
    _cast_parameters(gpt, config.params_dtype)
    if model.moe.freeze_router:
        for name, parameter in gpt.named_parameters():
            if name.endswith("mlp.router.weight"):
                parameter.requires_grad_(False)
    if device is not None:
        gpt.to(device)
    if lora is not None and lora.enabled:
        _freeze_all_but_adapters(gpt)
        initialize_adapters(gpt, model, seed, place)
    return gpt


LORA_SECTIONS = "actor.lora, sft.lora, dpo.lora or rm.lora"
"""The build is not told which section its adapter settings came from, so its messages name
them all; a check at config validation would name the one (see config/lora.py)."""

_said: set[str] = set()
"""Warnings already printed by this process."""


def _check_lora_targets(lora: LoraConfig, model: ModelConfig) -> None:
    """Refuse targets that would build no adapter on this model (a job whose every weight is
    frozen trains nothing and would say nothing), and say once which targets adapt nothing
    while others do (config/lora.py: `model_errors`, `model_warning`)."""
    errors = lora.model_errors("lora", model)
    if errors:
        raise ValueError(f"the trained model's adapters ({LORA_SECTIONS}): "
                         + "; ".join(errors))
    warning = lora.model_warning("lora", model)
    if warning is not None and warning not in _said:
        _said.add(warning)
        print0(f"WARNING: the trained model's adapters ({LORA_SECTIONS}): {warning}")


def _freeze_all_but_adapters(gpt) -> None:
    """Only adapters (and a scalar head: peft's modules_to_save for a score head) train."""
    for name, parameter in gpt.named_parameters():
        scalar_head = (isinstance(getattr(gpt, "output_layer", None), ScalarHead)
                       and name.startswith("output_layer."))
        parameter.requires_grad_(adapter_of(name) is not None or scalar_head)


def _cast_parameters(gpt, dtype: torch.dtype) -> None:
    """Give every parameter the model's dtype. Megatron's local spec builds its RMSNorms
    (WrappedTorchNorm) in fp32 whatever `params_dtype` says; in a bf16 model that makes every
    norm run unfused with mixed dtypes (seen on an H100), unlike Transformer Engine's norms and
    HF's bf16 models. Buffers (RoPE frequencies) keep their precision."""
    for parameter in gpt.parameters():
        if parameter.dtype.is_floating_point and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)
