"""One trained role's Megatron state (model, optimizer, LR schedule) and a rank's random
generators, as Megatron-Core's sharded state dicts: what training/checkpointer.py writes into and
reads from each checkpoint directory.

Weights and optimizer state use Megatron's own sharded state dicts, as Megatron-LM does: the
(DDP-unwrapped) model's `sharded_state_dict()` and `optimizer.sharded_state_dict(model_sharded
_state_dict)`, the distributed optimizer in Megatron-LM's default `dp_reshardable` format (each
DP rank writes its own buffer shards, no gather). Three Megatron-Core 0.16 code paths need help
(see the functions below): a scalar head in LanguageModule.sharded_state_dict, and loading the
DistributedOptimizer without Apex/Transformer Engine (torch.optim.Adam): a fresh optimizer has no
state to describe, and the per-parameter Adam step is not restored.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from mcore_rl.models.heads import ScalarHead
from mcore_rl.runtime.process_guard import helper_processes_guarded

from .optimizer import inner_optimizers

# Megatron-LM's `_build_sharded_state_dict_metadata` for Megatron-Core >= 0.14.
_SHARDING_METADATA = {"distrib_optim_sharding_type": "dp_reshardable",
                      "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def _sharding_metadata() -> dict:
    """A fresh metadata dict (Megatron adds its DP group to it in place)."""
    return dict(_SHARDING_METADATA)


def _copy_rng_state(state):
    """A snapshot of one tracker state: a CPU ByteTensor, or a Generator's state when the
    tracker keeps Generators (CUDA-graph-safe RNG)."""
    return state.get_state() if isinstance(state, torch.Generator) else state.clone()


def rng_states() -> dict:
    """Every generator this rank draws from. On the CPU the tracker's states are CPU generator
    states (runtime/cpu_compat.py maps Megatron's CUDA RNG calls to the CPU generator)."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    states = {"python": random.getstate(), "numpy": np.random.get_state(),
              "torch_cpu": torch.get_rng_state(),
              "megatron_tracker": {name: _copy_rng_state(state)
                                   for name, state in tracker.items()}}
    if torch.cuda.is_available():
        states["torch_cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    """Inverse of `rng_states`."""
    from megatron.core import tensor_parallel

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch_cpu"])
    if torch.cuda.is_available() and "torch_cuda" in states:
        torch.cuda.set_rng_state(states["torch_cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    current = tracker.get_states()
    restored = {}
    for name, saved in states["megatron_tracker"].items():
        if isinstance(current.get(name), torch.Generator):
            current[name].set_state(saved)
            restored[name] = current[name]
        else:
            restored[name] = saved.clone()
    tracker.set_states(restored)


def _model_sharded_state_dict(gpt) -> dict:
    """Megatron's sharded state dict of a (DDP-unwrapped) GPTModel.

    With a scalar head, LanguageModule.sharded_state_dict fails: it marks the LM head's
    `output_layer.weight` as padded (KeyError), and a scalar head has none. Its only other work
    (tying embeddings, dropping the LM head's extra state) does not apply to a scalar head, so
    for one the generic MegatronModule implementation gives the same entries."""
    from megatron.core.transformer.module import MegatronModule

    if isinstance(getattr(gpt, "output_layer", None), ScalarHead):
        return MegatronModule.sharded_state_dict(gpt, metadata=_sharding_metadata())
    return gpt.sharded_state_dict(metadata=_sharding_metadata())


def _allocate_state_for_loading(optimizer) -> None:
    """Give a fresh DistributedOptimizer zeroed Adam state at step 0 before loading into it.

    Without Apex or Transformer Engine, Megatron's Adam is torch.optim.Adam, whose state (and
    its per-parameter `step`) exists only after the first step; DistributedOptimizer.state_dict(),
    which sharded_state_dict(is_loading=True) calls first, then fails on `assert len(steps) ==
    1`. Megatron's own init_state_fn allocates the moments; the step is what torch would
    create. Everything is overwritten by the load."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for inner in inner_optimizers(optimizer):
        if not isinstance(inner, distrib_optimizer.DistributedOptimizer):
            continue
        if len(inner.optimizer.state) or inner.init_state_fn is None:
            continue
        inner.init_state_fn(inner.optimizer, inner.config)
        for state in inner.optimizer.state.values():
            state["step"] = torch.zeros((), dtype=torch.float32)


def _restore_steps(optimizer, loaded: dict) -> None:
    """Set every parameter's Adam `step` of a DistributedOptimizer to the checkpoint's.

    Without Apex or Transformer Engine (torch.optim.Adam keeps a `step` tensor per parameter),
    Megatron's DistributedOptimizer loses the step on load: load_state_dict puts the
    checkpoint's step into one tensor shared by every parameter, then the dp_reshardable
    parameter-state loader copies the *pre-load* step (kept as a LocalNonpersistentObject) into
    it. A shared tensor would also be incremented once per parameter by Adam. So each
    parameter gets its own tensor holding the step saved in the param groups."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    inners = inner_optimizers(optimizer)
    states = [loaded] if len(inners) == 1 else [loaded[index] for index in range(len(inners))]
    for inner, state in zip(inners, states):
        if not isinstance(inner, distrib_optimizer.DistributedOptimizer):
            continue
        steps = {group["step"] for group in state["optimizer"]["param_groups"]}
        if len(steps) != 1:
            raise ValueError(f"optimizer param groups hold different Adam steps {sorted(steps)}")
        step = steps.pop()
        for param_state in inner.optimizer.state.values():
            param_state["step"] = torch.tensor(step, dtype=torch.float32)


def has_state(optimizer) -> bool:
    """Whether this rank's optimizer has Adam state (it appears with the first step)."""
    return any(len(getattr(inner.optimizer, "state", {}))
               for inner in inner_optimizers(optimizer))


def _role_state_dict(model, is_loading: bool, with_optimizer: bool) -> dict:
    """{"model", "optimizer", "scheduler"} of one trained role, as ShardedTensors/objects.
    Without `with_optimizer` (no step taken yet: a fresh optimizer is the right state) the
    optimizer is left out. A model that trains adapters (model.base set) keeps its trained
    parameters only: its frozen base is the one `init` names, checked against the marker."""
    if len(model.chunks) != 1:
        raise NotImplementedError("training-state checkpoints support one model chunk per rank "
                                  f"(no virtual pipeline stages), got {len(model.chunks)}")
    module = model.chunks[0].module
    model_state = _model_sharded_state_dict(module)
    if model.base is not None:
        trained = {name for name, param in module.named_parameters() if param.requires_grad}
        model_state = {key: value for key, value in model_state.items() if key in trained}
    state = {"model": model_state, "scheduler": model.scheduler.state_dict()}
    if with_optimizer:
        state["optimizer"] = model.optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=_sharding_metadata())
    return state


def save_role(directory: str, model, with_optimizer: bool) -> None:
    from megatron.core import dist_checkpointing

    with helper_processes_guarded():  # the torch_dist writer's Manager, started by the first save
        dist_checkpointing.save(_role_state_dict(model, False, with_optimizer), directory)


@torch.no_grad()
def load_role(directory: str, model, with_optimizer: bool) -> None:
    """Load one role in place. Under no_grad: with fp32 parameters the distributed optimizer's
    main parameters are views of the model's, and Megatron's dp_reshardable loader copies into
    them without disabling autograd itself."""
    from megatron.core import dist_checkpointing

    if with_optimizer:
        _allocate_state_for_loading(model.optimizer)
    loaded = dist_checkpointing.load(_role_state_dict(model, True, with_optimizer), directory)
    # With adapters the frozen base is not in the checkpoint: it came from `init`.
    model.chunks[0].module.load_state_dict(loaded["model"], strict=model.base is None)
    if with_optimizer:
        model.optimizer.load_state_dict(loaded["optimizer"])
        _restore_steps(model.optimizer, loaded["optimizer"])
    model.scheduler.load_state_dict(loaded["scheduler"])
