"""Reading the parts of a Megatron-Core layer spec, whichever release built it.

The spec is what this package edits before a model is built (SDPA attention, the plain router,
LoRA's linears), and its shape is Megatron-Core's to change: the one place that knows how each
supported release describes a part is here.
"""

from __future__ import annotations

import functools


def mlp_submodules(layer_spec):
    """The submodules of a layer spec's MLP (dense or MoE), to be changed in place."""
    return submodules_of(layer_spec.submodules.mlp)


def submodules_of(part):
    """The submodules of one part of a spec (an MLP, an MoE layer's shared expert), to be
    changed in place. Megatron-Core 0.16 describes a part as a ModuleSpec with `submodules`;
    from 0.17 on as a functools.partial of a class or builder with `submodules` as a keyword."""
    if isinstance(part, functools.partial):
        return part.keywords["submodules"]
    return part.submodules
