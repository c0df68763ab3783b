"""Weights into a running vLLM engine: shards copied in place, each layer re-processed.

Why this module exists
----------------------
Weights arrive as this rank's rollout-TP shards in vLLM's own layout (the resharder's ``vllm``
layout: [q; k; v] of its heads, [gate; up], the vocabulary padded as vLLM pads it, under vLLM's
parameter names), so no rank receives or builds a tensor it does not keep. They are copied in
place into vLLM's parameters, and each touched layer's weight processing is run again, as
vLLM's loader does after a load: on GPUs that processing does nothing for unquantized layers
(the copy is vLLM's kernel-format reload), on CPUs it re-packs the oneDNN GEMM handle, which is
where the CPU backend keeps a linear layer's weight once loaded (the parameter itself is
emptied). An expert's shard is a slot of its layer's fused parameters. What each parameter
must receive is read here too (`parameter_shapes`, which `VllmEngine.check_plan` compares with
the plan), and what a CPU engine's sleep releases (`release_packed_weights`). The functions
taking a ``worker`` run inside vLLM's worker, through `LLM.collective_rpc`.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from mcore_rl.config.model import ModelConfig
from mcore_rl.resharding.vllm_shards import VLLM_EXPERT_SLOT


def tied_head_of(model: ModelConfig) -> str | None:
    """The module that shares the embedding's weight (vLLM's lm_head when tied)."""
    return "lm_head" if model.tie_embeddings else None


def load_shards(worker, named_tensors: Iterable[tuple[str, torch.Tensor]],
                layer_completed_by: set[str], tied_head: str | None) -> None:
    """Copy (vLLM name, shard) pairs into the model's parameters as they arrive, and run a
    layer's weight processing again as soon as its last parameter is in (see the module
    docstring). On CPUs a linear layer's parameter is empty once packed: the shard becomes the
    parameter again, for the processing to pack and release; each shard is let go before the
    next is asked for, so a sync holds one shard besides the resharder's buckets. An expert's
    shard is a slot of its layer's fused parameters (`_load_expert`)."""
    model = worker.model_runner.get_model()
    staged: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        slot = VLLM_EXPERT_SLOT.match(name)
        module_name, _, param_name = (slot.group(1) if slot else name).rpartition(".")
        module = model.get_submodule(module_name)
        if slot:
            _load_expert(module, param_name, int(slot.group(2)), tensor,
                         staged.setdefault(module_name, {}))
        else:
            param = getattr(module, param_name)
            if param.numel() == 0:
                setattr(module, param_name, torch.nn.Parameter(tensor, requires_grad=False))
            else:
                param.data.copy_(tensor)
            del param
        del tensor
        if name in layer_completed_by:
            if slot:
                _process_experts(module, staged.pop(module_name))
            else:
                _process_weights(module)
    if tied_head is not None:
        _process_weights(model.get_submodule(tied_head))


def _experts_prepacked() -> bool:
    """Whether vLLM keeps fused experts repacked after loading (its CPU kernel: intermediate
    size zero-padded to a multiple of 32, then prepacked), which it does once, at start-up:
    a weight update re-runs the method's processing but not the kernel's repack."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _load_expert(module: torch.nn.Module, param_name: str, expert: int, tensor: torch.Tensor,
                 staged: dict[str, torch.Tensor]) -> None:
    """Expert ``expert``'s shard into its slot of fused parameter ``param_name`` (w13_weight:
    [experts, 2 x FFN/TP, hidden], w2_weight: [experts, hidden, FFN/TP]). Where the engine
    repacks experts (`_experts_prepacked`) the slot is in a staged checkpoint-layout tensor
    that replaces the parameter once the layer is complete; elsewhere it is copied in place
    (CUDA graphs hold the parameter's address)."""
    if not _experts_prepacked():
        getattr(module, param_name).data[expert].copy_(tensor)
        return
    if param_name not in staged:
        staged[param_name] = tensor.new_empty((module.local_num_experts, *tensor.shape))
    staged[param_name][expert].copy_(tensor)


def _process_experts(module: torch.nn.Module, staged: dict[str, torch.Tensor]) -> None:
    """vLLM's post-load processing of a fused-experts layer whose every slot has arrived: the
    staged tensors become its parameters, its method's processing runs, and where the engine
    repacks experts the kernel's repack runs too (vLLM skips it after the first load, and
    the kernel would multiply by the stale packed weights: the log-probs of an updated model
    were 0.011 off transformers' before this)."""
    for param_name, tensor in staged.items():
        setattr(module, param_name, torch.nn.Parameter(tensor, requires_grad=False))
    method = module.quant_method
    method.process_weights_after_loading(module)
    if staged:
        method.moe_kernel.fused_experts.process_weights_after_loading(module)


def refresh_tied_head(worker, tied_head: str | None) -> None:
    """After vLLM's own checkpoint-format reload: repack the tied LM head, which that reload
    skips (its weight is the embedding's)."""
    if tied_head is not None:
        _process_weights(worker.model_runner.get_model().get_submodule(tied_head))


def _process_weights(module: torch.nn.Module) -> None:
    """vLLM's post-load weight processing of one layer. vLLM 0.32's CPU layers multiply
    through a oneDNN handle packed from the weight, which a load does not refresh by itself (a
    stale handle samples from the start-up dummy weights); the old handle is dropped before
    the new one is packed, so the two never coexist. GPUs: nothing happens for unquantized
    layers."""
    method = getattr(module, "quant_method", None)
    if method is None:
        return
    module.__dict__.pop("cpu_linear", None)
    method.process_weights_after_loading(module)


def release_packed_weights(worker) -> int:
    """Drop every CPU layer's packed GEMM handle (vLLM's `cpu_linear`); returns its bytes. A
    linear layer's parameter is already empty once packed, so its weight is then gone until
    `load_shards` sets and packs it again; the embedding keeps its parameter (its lookup, and
    the tied head's packing, read it). Fused experts are packed once at start-up, not by a
    load, and stay."""
    model = worker.model_runner.get_model()
    released = 0
    for module in model.modules():
        if module.__dict__.pop("cpu_linear", None) is not None:
            weight = module.weight
            released += math.prod(_loadable_shape(module, weight)) * weight.element_size()
    return released


def _loadable_shape(module: torch.nn.Module, param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape as a load delivers it; a CPU linear layer's packed parameter is
    empty, and its shape is the [out, in] of its partition (replicated: of the layer)."""
    if param.numel() == 0 and hasattr(module, "output_size_per_partition"):
        return (module.output_size_per_partition, module.input_size_per_partition)
    if param.numel() == 0 and hasattr(module, "output_size"):  # replicated (MoE gates)
        return (module.output_size, module.input_size)
    return tuple(param.shape)


def parameter_shapes(worker) -> dict[str, tuple[int, ...]]:
    """Each parameter's loadable shape (`_loadable_shape`), a fused-experts layer's for each
    expert's slot (``w13_weight[e]``: [2 x FFN/TP, hidden], ``w2_weight[e]``: [hidden,
    FFN/TP])."""
    model = worker.model_runner.get_model()
    shapes = {}
    for name, param in model.named_parameters():
        module_name, _, param_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        if param_name in _EXPERT_SLOT_SHAPES and hasattr(module, "moe_config"):
            moe = module.moe_config
            slot = _EXPERT_SLOT_SHAPES[param_name](moe.hidden_dim,
                                                   moe.intermediate_size_per_partition)
            shapes.update({f"{name}[{expert}]": slot
                           for expert in range(module.local_num_experts)})
        else:
            shapes[name] = _loadable_shape(module, param)
    return shapes


_EXPERT_SLOT_SHAPES = {"w13_weight": lambda hidden, ffn: (2 * ffn, hidden),
                       "w2_weight": lambda hidden, ffn: (hidden, ffn)}
"""One expert's loadable shape in a fused-experts parameter, from (hidden, FFN/TP)."""
