"""Adapters (LoRA) written as an HF peft adapter: `adapter_config.json` +
`adapter_model.safetensors` under HF module names, which `peft.PeftModel.from_pretrained`
loads onto the base HF model.

Megatron fuses q, k and v into one linear (and gate and up into another); peft keeps them
apart. A fused adapter (A [r, H], B [rows, r]) is exactly one peft adapter per part: each takes
the same A and its own rows of B (B A's rows are the update's rows), cut as the weight's rows are
(conversion/architectures: per-group QKV rows, [gate; up] halves).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from ..config.lora import LoraConfig
from ..param_layout import sharding
from ..param_layout.sharding import ShardKind
from .architectures import Architecture
from .architectures.hf_tensors import split_qkv

ADAPTER_DIR = "adapter"
"""Subfolder of an HF export holding the peft adapter."""

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def peft_tensors(full_adapters: dict[str, torch.Tensor], model: ModelConfig,
                 architecture: Architecture) -> dict[str, torch.Tensor]:
    """Full adapters (canonical global names) -> peft's saved tensors by key."""
    tensors = {}
    for name, lora_a in full_adapters.items():
        base, matrix = sharding.adapter_of(name)
        if matrix != "lora_a":
            continue
        lora_b = full_adapters[name.removesuffix("lora_a") + "lora_b"]
        hf_names = list(architecture.hf_shapes(base, model))
        kind = sharding.shard_kind(base)
        if kind is ShardKind.QKV:
            parts = split_qkv(lora_b, model)
        elif kind is ShardKind.GATE_UP:
            parts = lora_b.chunk(2, dim=0)
        else:
            parts = (lora_b,)
        for hf_name, part in zip(hf_names, parts, strict=True):
            module = PEFT_PREFIX + hf_name.removesuffix(".weight")
            tensors[f"{module}.lora_A.weight"] = lora_a.clone().contiguous()
            tensors[f"{module}.lora_B.weight"] = part.clone().contiguous()
    return tensors


def write_peft_adapter(out_dir: str, full_adapters: dict[str, torch.Tensor], model: ModelConfig,
                       lora: LoraConfig, architecture: Architecture,
                       base_model: str | None) -> str:
    """Write the adapter folder `out_dir` (one process; staged, then renamed) and return it.
    `base_model`: what adapter_config.json names as the base (init.hf_path)."""
    tensors = peft_tensors(full_adapters, model, architecture)
    modules = sorted({key.removeprefix(PEFT_PREFIX).split(".")[-3] for key in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
              "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "inference_mode": True,
              "base_model_name_or_path": base_model}
    staging = out_dir + ".incomplete"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    save_file(tensors, os.path.join(staging, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(staging, CONFIG_FILE), "w") as handle:
        json.dump(config, handle, indent=2)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(staging, out_dir)
    return out_dir
