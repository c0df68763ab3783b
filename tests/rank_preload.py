"""What the forkserver of `tests/world.py` imports once, so that no rank imports it again: the
heavy third-party libraries the ranks load (torch, Megatron-Core and the parts of it the package
uses, transformers' model classes the reference comparisons load, vLLM's engine front end:
together about 12 s of start-up per rank on these machines). The package itself is not
preloaded: some of its modules read the environment at import (the temporary directory), which a
rank takes from its test, not from the server.

Importing them starts no thread (forking after one would be unsafe); what they add to the
environment (vLLM sets inductor and NVML variables at import) is in ADDED_ENVIRONMENT, which a
rank adds to its test's environment, as if it had imported them itself.
"""

import importlib
import os
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
    "vllm", "vllm.entrypoints.llm", "vllm.engine.arg_utils",
]
_before = dict(os.environ)
with warnings.catch_warnings():  # said by each rank that imports them, not by the server
    warnings.simplefilter("ignore")
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # a module another megatron-core release moved: the rank imports it
            pass

ADDED_ENVIRONMENT = {name: value for name, value in os.environ.items()
                     if _before.get(name) != value}
