"""A trained model's adapters as an HF peft adapter folder next to its merged export.

Jobs that train adapters (actor.lora, sft.lora, dpo.lora) write both: the merged weights, which
every HF tool and `mcore-rl serve` load, and the adapter alone, which peft loads onto the base
(`PeftModel.from_pretrained(base, folder)`) and which is a small fraction of the model's size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.config import JobConfig
from mcore_rl.conversion.export import hf_architecture
from mcore_rl.conversion.peft_adapter import write_peft_adapter
from mcore_rl.models.lora import adapter_tensors, gather_full_adapters
from mcore_rl.models.weights import adapter_config_of, model_rank_of


def export_adapters(module: torch.nn.Module, config: JobConfig, out_dir: str) -> str | None:
    """Collective: gather the stage's adapters and write them as a peft adapter in `out_dir`
    (rank 0 writes; every rank returns after it is complete); None, writing nothing, when the
    stage carries no adapters."""
    lora = adapter_config_of(module)
    if lora is None:
        return None
    full = gather_full_adapters(adapter_tensors(module), config.model,
                                model_rank_of(module))
    if dist.get_rank() == 0:
        write_peft_adapter(out_dir, full, config.model, lora, hf_architecture(config),
                           config.init.hf_path)
    dist.barrier()
    return out_dir
