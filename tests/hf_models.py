"""Tiny random HF checkpoints of every supported architecture, written to disk for conversion
tests (no downloads). Vocabulary 251 is not divisible by any TP size; KV heads fewer than TP,
tied and untied embeddings, QKV bias, QK-norm, Llama-3 RoPE and head_dim != hidden/heads all
appear, and the three Mixture-of-Experts architectures (4 experts, top-2; a dense first layer,
renormalised and plain top-k, a gated shared expert)."""

from __future__ import annotations

import glob
import json
import os

import torch
import transformers
from safetensors.torch import load_file

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=251, max_position_embeddings=128, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

CASES = {
    "llama": (transformers.LlamaConfig, "LlamaForCausalLM",
              dict(num_key_value_heads=2, head_dim=16, rope_parameters=LLAMA3_ROPE)),
    "llama_tied_kv1": (transformers.LlamaConfig, "LlamaForCausalLM",
                       dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen2": (transformers.Qwen2Config, "Qwen2ForCausalLM",
              dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, "Qwen3ForCausalLM",
              dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, "MistralForCausalLM",
                dict(num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, "Qwen3MoeForCausalLM",
                  dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0])),
    "qwen2_moe": (transformers.Qwen2MoeConfig, "Qwen2MoeForCausalLM",
                  dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       norm_topk_prob=False)),
    "mixtral": (transformers.MixtralConfig, "MixtralForCausalLM",
                dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=None)),
}


def build_hf_model(case: str, **overrides) -> transformers.PreTrainedModel:
    """A tiny model with random weights (norms near 1, biases non-zero); `overrides` change
    the case's config."""
    config_class, arch_name, extra = CASES[case]
    config = config_class(**{**SMALL, **extra, **overrides}, architectures=[arch_name])
    torch.manual_seed(sum(map(ord, case)))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            centre = 1.0 if "norm" in name else 0.0
            param.copy_(centre + 0.15 * torch.randn_like(param))
    return model


def write_tokenizer(folder: str, vocab_size: int) -> None:
    """A word-level tokenizer with `vocab_size` tokens, saved as HF tokenizer files."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def save_hf_case(case: str, folder: str, **overrides) -> transformers.PreTrainedModel:
    """Write the case as an HF folder (safetensors split in two files, tokenizer)."""
    model = build_hf_model(case, **overrides)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="60KB")
    write_tokenizer(folder, model.config.vocab_size)
    with open(os.path.join(folder, "config.json")) as handle:
        assert json.load(handle)["architectures"] == [CASES[case][1]]
    return model


def reference_batch(vocab_size: int = 251, seq_length: int = 12, rows: int = 4):
    """Right-padded token ids and mask (one full row)."""
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab_size, (rows, seq_length), generator=generator)
    lengths = torch.tensor([seq_length, 7, 3, 10])[:rows]
    mask = (torch.arange(seq_length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return ids * mask, mask


@torch.no_grad()
def hf_logits(model, ids, mask) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask).logits.float()


def write_tiny_qwen3_moe(folder: str, vocabulary: tuple[str, ...]) -> str:
    """Qwen3-MoE (a dense first layer, then 4 experts, top-2 renormalised) with random weights
    and a word-level tokenizer over `vocabulary` (its <pad> and <eos> named), as an HF folder:
    what the dataset jobs' MoE tests train."""
    from mcore_rl.data.toy import write_word_tokenizer

    config = transformers.Qwen3MoeConfig(
        vocab_size=len(vocabulary), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[0], tie_word_embeddings=False, pad_token_id=vocabulary.index("<pad>"),
        eos_token_id=vocabulary.index("<eos>"), bos_token_id=None)
    torch.manual_seed(5)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(folder)
    write_word_tokenizer(folder, vocabulary)
    return folder


def toy_llama(folder: str, hidden_size: int = 128, intermediate_size: int = 256,
              num_layers: int = 2, num_heads: int = 2, num_kv_heads: int = 2,
              seed: int = 0) -> str:
    """A random HF Llama of the toy task's shape (configs/grpo_toy.yaml: vocabulary 16, head_dim
    64 as vLLM's CPU attention needs) written to `folder`; wider or deeper ones by argument."""
    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def toy_qwen3_moe(folder: str, seed: int = 2) -> str:
    """A random HF Qwen3-MoE on the toy task's vocabulary (16): a dense first layer, then 4
    experts (top-2, renormalised) in each of the other two layers."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=16, hidden_size=128, intermediate_size=192, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
        mlp_only_layers=[0], tie_word_embeddings=False, rms_norm_eps=1e-5,
        architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(seed)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(folder)
    return folder


def hf_state(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder's safetensors files, by name."""
    state = {}
    for file in glob.glob(os.path.join(folder, "*.safetensors")):
        state.update(load_file(file))
    return state


def assert_same_hf_folder(original_dir: str, exported_dir: str, hf_model) -> None:
    """The export holds the same tensors bit for bit and the same tokenizer files, and
    transformers loads it into a model with the original's logits."""
    original, exported = hf_state(original_dir), hf_state(exported_dir)
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(original_dir, name)) as original_file, \
                open(os.path.join(exported_dir, name)) as exported_file:
            assert original_file.read() == exported_file.read(), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported_dir).eval()
    ids, mask = reference_batch()
    assert torch.equal(hf_logits(reloaded, ids, mask), hf_logits(hf_model, ids, mask))
