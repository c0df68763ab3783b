"""What the forkserver of `tests/world.py` imports once, so that no rank imports it again: the
heavy third-party libraries every rank loads (torch, Megatron-Core and the parts of it the
package uses, transformers' model classes the reference comparisons load). The package itself is
not preloaded: some of its modules read the environment at import (the temporary directory),
which a rank takes from its test, not from the server."""

import importlib
import warnings


MODULES = [
    "numpy", "torch", "torch.distributed", "safetensors.torch", "omegaconf",
    "megatron.core", "megatron.core.parallel_state", "megatron.core.tensor_parallel",
    "megatron.core.optimizer", "megatron.core.optimizer_param_scheduler",
    "megatron.core.distributed", "megatron.core.dist_checkpointing",
    "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer", "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.router_replay", "megatron.core.pipeline_parallel",
    "megatron.core.hyper_comm_grid", "megatron.core.process_groups_config",
    "megatron.core.inference.contexts",
    "transformers", "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
]
with warnings.catch_warnings():  # said by each rank that imports them, not by the server
    warnings.simplefilter("ignore")
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # a module another megatron-core release moved: the rank imports it
            pass
