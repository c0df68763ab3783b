"""Reading the parts of a Megatron-Core layer spec, whichever release built it.

The spec is what this package edits before a model is built (SDPA attention, the plain router,
LoRA's linears), and its shape is Megatron-Core's to change: the one place that knows how each
supported release describes a part is here.
"""

from __future__ import annotations

import functools


def mlp_submodules(layer_spec):
    """The submodules of a layer spec's MLP (dense or MoE), to be changed in place. Megatron-Core
    0.16 describes the MLP as a ModuleSpec with `submodules`; from 0.17 on it is a
    functools.partial of the module's class with `submodules` as a keyword."""
    mlp = layer_spec.submodules.mlp
    if isinstance(mlp, functools.partial):
        return mlp.keywords["submodules"]
    return mlp.submodules
