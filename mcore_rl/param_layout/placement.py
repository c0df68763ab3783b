"""Pipeline and expert parallelism: which stage (and expert-parallel rank) holds a parameter, and
under which local name.

Why this module exists
----------------------
Megatron numbers layers (and experts) locally on each pipeline stage (expert-parallel rank), so
a parameter's name differs between the canonical full model and the rank that holds it. The
translation between global and local names, which stage owns which layer, and the list of a
stage's parameters are written once here (see the "Pipeline layout" section of
`mcore_rl.param_layout.sharding`'s docstring).
"""

from __future__ import annotations

from mcore_rl.config.model import ModelConfig
from mcore_rl.config.parallel import pipeline_stage_layers
from mcore_rl.param_layout.adapters import adapter_of
from mcore_rl.param_layout.rules import (EMBEDDING, OUTPUT_LAYER, _layer_index, _rule,
                                         _with_expert_index, _with_layer_index,
                                         canonical_param_shapes, expert_of)
from mcore_rl.param_layout.tensor_parallel import _check_rank


def stage_layers(model: ModelConfig, pp_size: int) -> tuple[int, ...]:
    """Transformer layers on each pipeline stage (config.parallel's rule, even when possible)."""
    return pipeline_stage_layers(model.num_layers, pp_size)


def first_layer(model: ModelConfig, pp_size: int, pp_rank: int) -> int:
    """Global index of the first layer on pipeline stage ``pp_rank``."""
    return sum(stage_layers(model, pp_size)[:pp_rank])


def stage_of_layer(global_layer: int, model: ModelConfig, pp_size: int) -> tuple[int, int]:
    """(pipeline stage, local layer index) holding global layer ``global_layer``."""
    if not 0 <= global_layer < model.num_layers:
        raise ValueError(f"layer {global_layer} is outside [0, {model.num_layers})")
    local = global_layer
    for stage, layers in enumerate(stage_layers(model, pp_size)):
        if local < layers:
            return stage, local
        local -= layers
    raise AssertionError("the stages hold every layer")


def _check_known(name: str) -> None:
    """Raise ValueError unless ``name`` is a parameter or an adapter of one."""
    adapter = adapter_of(name)
    _rule(adapter[0] if adapter else name)


def _stage_of_global_param(name: str, pp_size: int) -> int:
    """Pipeline stage that owns non-layer parameter ``name`` (embedding first, head last)."""
    _rule(name)  # raises for unknown names
    return 0 if name.startswith("embedding.") else pp_size - 1


def to_global_name(local_name: str, pp_rank: int, model: ModelConfig, pp_size: int) -> str:
    """The global-index name of ``local_name`` as it appears on stage ``pp_rank``. Only layer
    indices change; the spelling (local spec or TE) is kept."""
    _check_rank(pp_rank, pp_size, "pp_rank")
    on_stage = stage_layers(model, pp_size)[pp_rank]
    _check_known(local_name)
    local = _layer_index(local_name)
    if local is None:
        owner = _stage_of_global_param(local_name, pp_size)
        if owner != pp_rank:
            raise ValueError(f"{local_name!r} lives on pipeline stage {owner}, not {pp_rank}")
        return local_name
    if local >= on_stage:
        raise ValueError(f"{local_name!r}: local layer {local} is outside [0, {on_stage}) on "
                         f"pipeline stage {pp_rank}")
    return _with_layer_index(local_name, first_layer(model, pp_size, pp_rank) + local)


def to_local_name(global_name: str, model: ModelConfig, pp_size: int) -> tuple[int, str]:
    """(pipeline stage, local name) of the global-index name ``global_name``. For a tied model's
    ``output_layer.weight`` this is its last-stage copy."""
    _check_known(global_name)
    layer = _layer_index(global_name)
    if layer is None:
        return _stage_of_global_param(global_name, pp_size), global_name
    pp_rank, local = stage_of_layer(layer, model, pp_size)
    return pp_rank, _with_layer_index(global_name, local)


def has_tied_output_copy(model: ModelConfig, pp_size: int, pp_rank: int,
                         head: str = "lm") -> bool:
    """True on the stage where Megatron keeps ``output_layer.weight`` as a copy of the embedding
    (LM head, tied embeddings, more than one stage, last stage)."""
    return head == "lm" and model.tie_embeddings and pp_size > 1 and pp_rank == pp_size - 1



def experts_per_rank(model: ModelConfig, ep_size: int) -> int:
    """Experts each expert-parallel rank holds (they are split evenly)."""
    errors = model.moe.expert_parallel_errors(ep_size)
    if errors:
        raise ValueError(errors[0])
    return model.moe.num_experts // ep_size


def stage_params(model: ModelConfig, pp_size: int, pp_rank: int, head: str = "lm",
                 ep_size: int = 1, ep_rank: int = 0) -> dict[str, str]:
    """Local parameter names on pipeline stage ``pp_rank`` and expert-parallel rank ``ep_rank``
    (in Megatron's named_parameters order) -> the canonical full name each comes from. With
    tied embeddings and P > 1, the last stage's ``output_layer.weight`` maps to
    ``embedding.word_embeddings.weight``."""
    stage_layers(model, pp_size)
    _check_rank(pp_rank, pp_size, "pp_rank")
    _check_rank(ep_rank, ep_size, "ep_rank")
    per_rank = experts_per_rank(model, ep_size) if model.moe.enabled else 0
    params = {}
    for name in canonical_param_shapes(model, head):
        owner, local = to_local_name(name, model, pp_size)
        expert = expert_of(name)
        if expert is not None:
            if expert // per_rank != ep_rank:
                continue
            local = _with_expert_index(local, expert % per_rank)
        if owner == pp_rank:
            params[local] = name
    if has_tied_output_copy(model, pp_size, pp_rank, head):
        params[OUTPUT_LAYER] = EMBEDDING
    return params
