"""How each Megatron-Core parameter is laid out across tensor- and pipeline-parallel ranks.

Why this module exists
----------------------
Every change of layout in the system - HF checkpoint conversion, resharding trained weights into
vLLM's tensor-parallel layout, merging a distributed checkpoint back into one file - has to
answer the same questions: which rows of which tensor does rank (tp, pp) hold, under which local
name? If two of those paths answered differently, weights would be silently permuted (a wrong
KV head is not an error, just a worse model). So all of them go through the rules written once
here (and in the sibling modules named below), and they are pure (torch only: no
torch.distributed, no Megatron imports) so the rules can be tested exhaustively in-process.

The canonical full layout
-------------------------
"Canonical full" means: Megatron-Core GPTModel parameter names of the *local* layer spec at
TP=1, PP=1, with GLOBAL layer indices, and the vocabulary UNPADDED (exactly ``vocab_size`` rows).
With nq query heads, nkv KV heads, head width d, hidden H, FFN width F, vocab V::

    embedding.word_embeddings.weight                      [V, H]             VOCAB
    decoder.layers.{i}.input_layernorm.weight             [H]                REPLICATED
    decoder.layers.{i}.self_attention.linear_proj.weight  [H, nq*d]          ROW
    decoder.layers.{i}.self_attention.linear_qkv.weight   [(nq+2*nkv)*d, H]  QKV
    decoder.layers.{i}.self_attention.linear_qkv.bias     [(nq+2*nkv)*d]     QKV   (qkv_bias)
    decoder.layers.{i}.self_attention.q_layernorm.weight  [d]                REPLICATED (qk_norm)
    decoder.layers.{i}.self_attention.k_layernorm.weight  [d]                REPLICATED (qk_norm)
    decoder.layers.{i}.pre_mlp_layernorm.weight           [H]                REPLICATED
    decoder.layers.{i}.mlp.linear_fc1.weight              [2*F, H]           GATE_UP
    decoder.layers.{i}.mlp.linear_fc2.weight              [H, F]             ROW
    decoder.final_layernorm.weight                        [H]                REPLICATED
    output_layer.weight                                   [V, H]             VOCAB (untied only)

A Mixture-of-Experts layer (model.moe; E experts of FFN width Fe, shared expert width Fs) has,
in place of the two ``mlp.linear_fc*`` tensors::

    decoder.layers.{i}.mlp.router.weight                                 [E, H]    REPLICATED
    decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight   [2*Fe, H] GATE_UP
    decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight   [H, Fe]   ROW
    decoder.layers.{i}.mlp.shared_experts.gate_weight                    [1, H]    REPLICATED (gate)
    decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight              [2*Fs, H] GATE_UP (Fs > 0)
    decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight              [H, Fs]   ROW     (Fs > 0)

with the GLOBAL expert index e. An expert's matrices are split like the dense MLP's, over the
expert tensor-parallel ranks (ETP; by default the TP ranks, `tensor_split`). Expert parallelism
(EP ranks) is like the pipeline for layers: EP rank r holds experts [r * E/EP, (r + 1) * E/EP)
and numbers them locally from 0.

Transformer-Engine spec names are accepted everywhere and mapped to these: TE fuses the norms into
the following linear, so ``...self_attention.linear_qkv.layer_norm_weight`` is
``...input_layernorm.weight`` and ``...mlp.linear_fc1.layer_norm_weight`` is
``...pre_mlp_layernorm.weight``. State-dict entries ending in ``_extra_state`` are not parameters.

Tensor-parallel layouts (Megatron's real ones)
----------------------------------------------
* QKV, TP=1: for each KV group g: [q heads of group g (nq/nkv heads), k head g, v head g], each
  head d rows. Query head j belongs to group j // (nq/nkv).
* QKV, any TP=t: rank r holds the contiguous dim-0 chunk r of the TP=1 layout (the bias likewise)
  and merging concatenates the chunks; no row is held by two ranks.
  - nkv % t == 0: the chunk is nkv/t whole groups, and Megatron's forward uses it locally.
  - t > nkv (t % nkv == 0, (nq + 2*nkv)*d % t == 0): Megatron is still built with
    num_query_groups = nkv, and a chunk may cut through a group. In forward, Megatron's native
    path (``get_query_key_value_tensors``) all-gathers the mixed QKV activations along the last
    dim on every rank, takes group r // (t/nkv), splits it into q heads, k and v, and keeps that
    group's q heads [s * nq/t, (s + 1) * nq/t) (numbered within the group, s = r % (t/nkv)).
    No parameter is duplicated, so gradients and gradient norms are exact and there are no KV
    copies to keep in sync.
* GATE_UP (fused SwiGLU linear_fc1): TP=1 is cat([gate, up]); rank r holds
  cat([gate chunk r, up chunk r]) so each rank can apply SwiGLU locally.
* COLUMN: chunk dim 0. ROW: chunk dim 1 (partial sums are all-reduced).
* VOCAB: pad [V, H] with zero rows to ``padded_vocab_size(t)``, then chunk dim 0; merging
  concatenates and drops the padding.
* REPLICATED: every rank holds the full tensor.

Pipeline layout
---------------
Stage p owns a run of consecutive global layers (L/P of them when P divides L, otherwise
`config.parallel.pipeline_stage_layers`' uneven split) and numbers them locally from 0. The
embedding is on stage 0; the final norm and output layer on the last stage. With tied embeddings
and P > 1 Megatron also creates ``output_layer.weight`` on the last stage, a copy of the embedding.

Where the rules live
--------------------
This module is the package's front door (callers write ``sharding.X``) and holds the rules for
whole state dicts. The rules they build on live in sibling modules, one concern each, and are
re-exported here: `rules` (names, shapes, `ShardKind`), `tensor_parallel` (cutting and merging
one tensor), `placement` (pipeline stages and expert-parallel ranks) and `adapters` (LoRA).
"""

from __future__ import annotations

from typing import Mapping

import torch

from mcore_rl.config.model import ModelConfig

# The rules live in sibling modules by concern; every name is re-exported here, and callers name
# them as ``sharding.X``.
from mcore_rl.param_layout.adapters import (  # noqa: F401
    ADAPTER_MATRICES, adapted_weights, adapter_kind, adapter_of, merge_adapter, split_adapter)
from mcore_rl.param_layout.placement import (  # noqa: F401
    experts_per_rank, first_layer, has_tied_output_copy, stage_layers, stage_of_layer,
    stage_params, to_global_name, to_local_name)
from mcore_rl.param_layout.rules import (  # noqa: F401
    EMBEDDING, EXPERT_PREFIX, FINAL_NORM, HEADS, OUTPUT_LAYER, SCALAR_HEAD, ShardKind,
    canonical_name, canonical_param_shapes, expert_of, full_shape, is_parameter_name, shard_kind)
from mcore_rl.param_layout.tensor_parallel import (  # noqa: F401
    _check_layout, _check_rank, local_shape, merge_from_tp, split_for_tp, tensor_split)


# --------------------------------------------------------------------------------------------
# Whole state dicts
# --------------------------------------------------------------------------------------------

def _canonical_state(state: Mapping[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """``state`` without non-parameter entries and with TE names mapped to local-spec names;
    ValueError if two entries map to the same name."""
    result = {}
    for name, tensor in state.items():
        if not is_parameter_name(name):
            continue
        key = canonical_name(name)
        if key in result:
            raise ValueError(f"{where}: {name!r} and another entry both name {key!r}")
        result[key] = tensor
    return result


def shard_full_state(full_state: Mapping[str, torch.Tensor], model: ModelConfig, tp_size: int,
                     pp_size: int, tp_rank: int, pp_rank: int, head: str = "lm",
                     ep_size: int = 1, ep_rank: int = 0,
                     etp: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The local state (local names -> contiguous shards) of rank (tp_rank, pp_rank, ep_rank),
    cut from a canonical full state; etp: the rank's (size, rank) in expert TP (None: TP's).
    ``full_state`` may hold only some parameters, but must hold every one this stage needs and
    nothing that is not a parameter of this model."""
    _check_layout(model, tp_size, pp_size)
    _check_rank(tp_rank, tp_size, "tp_rank")
    _check_rank(pp_rank, pp_size, "pp_rank")
    state = _canonical_state(full_state, "full state")
    known = canonical_param_shapes(model, head)
    unknown = [name for name in state if name not in known]
    if unknown:
        raise ValueError(f"full state holds names that are not parameters of this model: {unknown}")
    local_state = {}
    for local, source in stage_params(model, pp_size, pp_rank, head, ep_size, ep_rank).items():
        if source not in state:
            raise ValueError(f"full state is missing {source!r} (needed as {local!r} on "
                             f"pipeline stage {pp_rank})")
        local_state[local] = split_for_tp(source, state[source], model,
                                          *tensor_split(source, (tp_size, tp_rank), etp))
    return local_state


def _stage_states(shards_by_rank: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
                  model: ModelConfig, tp_size: int, pp_size: int, pp_rank: int,
                  head: str) -> list[dict[str, torch.Tensor]]:
    """The canonicalised local states of every TP rank of stage ``pp_rank``, checked to hold
    exactly the stage's parameters."""
    expected = stage_params(model, pp_size, pp_rank, head)
    states = []
    for tp_rank in range(tp_size):
        where = f"rank (tp={tp_rank}, pp={pp_rank})"
        state = _canonical_state(shards_by_rank[(tp_rank, pp_rank)], where)
        missing = [name for name in expected if name not in state]
        extra = [name for name in state if name not in expected]
        if missing or extra:
            raise ValueError(f"{where}: missing parameters {missing}, unexpected {extra}")
        states.append(state)
    return states


def merge_shards(shards_by_rank: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
                 model: ModelConfig, tp_size: int, pp_size: int,
                 check_replicas: bool = False, head: str = "lm") -> dict[str, torch.Tensor]:
    """The canonical full state from every rank's local state, keyed by (tp_rank, pp_rank).
    A tied model's last-stage output-layer copy is dropped (compared with the embedding when
    ``check_replicas``). The result is ordered like `canonical_param_shapes`."""
    _check_layout(model, tp_size, pp_size)
    grid = {(tp, pp) for tp in range(tp_size) for pp in range(pp_size)}
    if set(shards_by_rank) != grid:
        raise ValueError(f"expected shards for every (tp_rank, pp_rank) in a {tp_size}x{pp_size} "
                         f"grid, got {sorted(shards_by_rank)}")
    merged = {}
    tied_copy = None
    for pp_rank in range(pp_size):
        states = _stage_states(shards_by_rank, model, tp_size, pp_size, pp_rank, head)
        for local, source in stage_params(model, pp_size, pp_rank, head).items():
            full = merge_from_tp(source, [state[local] for state in states], model, tp_size,
                                 check_replicas)
            if local == OUTPUT_LAYER and source == EMBEDDING:
                tied_copy = full
            else:
                merged[source] = full
    if check_replicas and tied_copy is not None and not torch.equal(tied_copy, merged[EMBEDDING]):
        raise ValueError(f"tied {OUTPUT_LAYER!r} on the last pipeline stage differs from "
                         f"{EMBEDDING!r} on the first")
    return {name: merged[name] for name in canonical_param_shapes(model, head)}
