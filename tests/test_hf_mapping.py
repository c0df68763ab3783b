"""Tests of the HF <-> canonical mapping (mcore_rl.conversion.architectures) against references
that do not come from the module: tiny random transformers models and their configs, a slow
head-by-head construction of the fused QKV, the projections computed straight from the HF
weights, and logits of a model rebuilt from the exported config."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import transformers

from mcore_rl.config.model import ModelConfig
from mcore_rl.conversion import ARCHITECTURES, architecture_for
from mcore_rl.param_layout import sharding

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=250, max_position_embeddings=256, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

CASES = {
    "llama_untied_kv2_llama3": (transformers.LlamaConfig, "LlamaForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        rope_parameters=LLAMA3_ROPE)),
    "llama_tied_kv1_smollm2": (transformers.LlamaConfig, "LlamaForCausalLM", dict(
        num_key_value_heads=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "qwen2_untied_kv2": (transformers.Qwen2Config, "Qwen2ForCausalLM", dict(
        num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2_tied_kv4": (transformers.Qwen2Config, "Qwen2ForCausalLM", dict(
        num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3_tied_kv2_wide_heads": (transformers.Qwen3Config, "Qwen3ForCausalLM", dict(
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
    "qwen3_untied_kv1": (transformers.Qwen3Config, "Qwen3ForCausalLM", dict(
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)),
    "mistral_untied_kv1": (transformers.MistralConfig, "MistralForCausalLM", dict(
        num_key_value_heads=1, sliding_window=None, tie_word_embeddings=False)),
    "mistral_tied_kv4": (transformers.MistralConfig, "MistralForCausalLM", dict(
        num_key_value_heads=4, sliding_window=None, tie_word_embeddings=True)),
}


@functools.lru_cache(maxsize=None)
def hf_case(case: str) -> tuple[dict, transformers.PreTrainedModel]:
    """(config.json dict as a file would hold it, tiny HF model with random weights)."""
    config_class, arch_name, extra = CASES[case]
    config = config_class(**SMALL, **extra, architectures=[arch_name])
    config_dict = json.loads(config.to_json_string())
    torch.manual_seed(sum(map(ord, case)))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms too, so a swapped norm would show
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if param.dim() == 1 else 0.0))
    return config_dict, model


def canonical_of(case: str):
    """(architecture, ModelConfig, HF config object, HF state dict) for a case."""
    config_dict, model = hf_case(case)
    arch = architecture_for(config_dict)
    return arch, arch.model_config(config_dict), model.config, model.state_dict()


def reference_fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                        kv_heads: int, head_dim: int) -> torch.Tensor:
    """Slow reference: walk KV groups and heads one by one, appending head_dim rows each."""
    rows = []
    heads_per_group = heads // kv_heads
    for group in range(kv_heads):
        for head in range(group * heads_per_group, (group + 1) * heads_per_group):
            rows.append(q[head * head_dim:(head + 1) * head_dim])
        rows.append(k[group * head_dim:(group + 1) * head_dim])
        rows.append(v[group * head_dim:(group + 1) * head_dim])
    return torch.cat(rows)


# ---------------------------------------------------------------------------------- (a) config

@pytest.mark.parametrize("case", sorted(CASES))
def test_model_config_matches_transformers_config(case):
    arch, model, config, state = canonical_of(case)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert arch.name == CASES[case][1]
    assert model.hidden_size == config.hidden_size
    assert model.ffn_hidden_size == config.intermediate_size
    assert model.num_layers == config.num_hidden_layers
    assert model.num_attention_heads == config.num_attention_heads
    assert model.kv_heads == config.num_key_value_heads
    assert model.kv_channels == head_dim
    assert model.vocab_size == config.vocab_size
    assert model.max_position_embeddings == config.max_position_embeddings
    assert model.norm_eps == config.rms_norm_eps
    assert model.tie_embeddings == config.tie_word_embeddings
    assert model.rope_theta == config.rope_parameters["rope_theta"]
    assert model.qkv_bias == ("model.layers.0.self_attn.q_proj.bias" in state)
    assert model.qk_norm == ("model.layers.0.self_attn.q_norm.weight" in state)
    rope = config.rope_parameters
    if rope["rope_type"] == "llama3":
        scaling = model.rope_scaling
        assert (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
                scaling.original_max_position_embeddings) == (
            rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
            rope["original_max_position_embeddings"])
    else:
        assert model.rope_scaling is None


@pytest.mark.parametrize("config_class, name", [
    (transformers.LlamaConfig, "LlamaForCausalLM"), (transformers.Qwen2Config, "Qwen2ForCausalLM"),
    (transformers.Qwen3Config, "Qwen3ForCausalLM"),
    (transformers.Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
    (transformers.Qwen2MoeConfig, "Qwen2MoeForCausalLM"),
    (transformers.MixtralConfig, "MixtralForCausalLM")])
def test_omitted_keys_take_transformers_defaults(config_class, name):
    model = ARCHITECTURES[name].model_config({"architectures": [name]})
    reference = config_class()
    if "Moe" in name or "Mixtral" in name:
        moe = model.moe
        assert (moe.num_experts, moe.router_topk, moe.normalize_topk, moe.dense_layers) == (
            reference.num_experts, reference.num_experts_per_tok,
            getattr(reference, "norm_topk_prob", True), ())
        assert moe.ffn_hidden_size == getattr(reference, "moe_intermediate_size",
                                              reference.intermediate_size)
        assert moe.shared_expert_ffn_hidden_size == getattr(
            reference, "shared_expert_intermediate_size", 0)
        assert model.rope_theta == reference.rope_parameters["rope_theta"]
    head_dim = getattr(reference, "head_dim", None)
    assert model.kv_channels == (head_dim or reference.hidden_size // reference.num_attention_heads)
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size, model.kv_heads,
            model.vocab_size, model.max_position_embeddings, model.norm_eps,
            model.tie_embeddings) == (
        reference.num_hidden_layers, reference.hidden_size, reference.intermediate_size,
        reference.num_key_value_heads, reference.vocab_size, reference.max_position_embeddings,
        reference.rms_norm_eps, reference.tie_word_embeddings)


def test_legacy_llama3_config_json_reads_like_transformers():
    legacy = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
              "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192,
                               "rope_type": "llama3"},
              "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 128000,
              "attention_dropout": 0.0, "transformers_version": "4.45.0.dev0"}
    model = architecture_for(legacy).model_config(legacy)
    reference = transformers.LlamaConfig(**legacy).rope_parameters
    assert model.rope_theta == reference["rope_theta"] == 500000.0
    assert model.rope_scaling.factor == reference["factor"] == 32.0
    assert model.rope_scaling.original_max_position_embeddings == 8192
    assert (model.kv_heads, model.kv_channels, model.tie_embeddings) == (8, 64, True)


def test_qwen2_unused_sliding_window_is_accepted():
    qwen25 = {"architectures": ["Qwen2ForCausalLM"], **SMALL, "num_key_value_heads": 2,
              "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 1,
              "rope_theta": 1000000.0, "rope_scaling": None}
    model = architecture_for(qwen25).model_config(qwen25)
    assert model.rope_theta == 1000000.0 and model.qkv_bias
    assert set(transformers.Qwen2Config(**qwen25).layer_types) == {"full_attention"}


# ---------------------------------------------------------------------------------- (b) QKV

@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_qkv_equals_head_by_head_reference(case):
    arch, model, config, state = canonical_of(case)
    heads, kv_heads, head_dim = model.num_attention_heads, model.kv_heads, model.kv_channels
    for layer in range(model.num_layers):
        for kind in ("weight", "bias") if model.qkv_bias else ("weight",):
            prefix = f"model.layers.{layer}.self_attn"
            q, k, v = (state[f"{prefix}.{p}_proj.{kind}"] for p in "qkv")
            name = f"decoder.layers.{layer}.self_attention.linear_qkv.{kind}"
            fused = arch.to_canonical(name, state, model)
            assert torch.equal(fused, reference_fused_qkv(q, k, v, heads, kv_heads, head_dim))


# ---------------------------------------------------------------------------------- (c) round trip

@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip_is_bit_identical_and_covers_every_tensor(case):
    arch, model, config, state = canonical_of(case)
    names = arch.hf_to_canonical_names(model)
    assert list(names) == list(sharding.canonical_param_shapes(model))
    mapped = [hf for sources in names.values() for hf in sources]
    expected = set(state) - ({"lm_head.weight"} if model.tie_embeddings else set())
    assert len(mapped) == len(set(mapped)) and set(mapped) == expected
    assert arch.is_redundant_hf_name("lm_head.weight", model) == model.tie_embeddings
    rebuilt = {}
    for name, shape in sharding.canonical_param_shapes(model).items():
        canonical = arch.to_canonical(name, state, model)
        assert tuple(canonical.shape) == shape and canonical.is_contiguous()
        parts = arch.from_canonical(name, canonical, model)
        assert list(parts) == names[name]
        pointers = [part.data_ptr() for part in parts.values()]
        assert len(set(pointers)) == len(pointers) or len(parts) == 1
        rebuilt.update(parts)
    assert set(rebuilt) == expected
    for hf_name, tensor in rebuilt.items():
        assert tensor.is_contiguous() and torch.equal(tensor, state[hf_name]), hf_name


def test_gate_up_is_gate_then_up():
    arch, model, config, state = canonical_of("llama_untied_kv2_llama3")
    fc1 = arch.to_canonical("decoder.layers.1.mlp.linear_fc1.weight", state, model)
    assert torch.equal(fc1[:96], state["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[96:], state["model.layers.1.mlp.up_proj.weight"])


# ---------------------------------------------------------------------------------- (d) numerics

@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_qkv_gives_hf_projections_when_split_like_megatron(case):
    arch, model, config, state = canonical_of(case)
    heads, kv_heads, head_dim = model.num_attention_heads, model.kv_heads, model.kv_channels
    prefix = "decoder.layers.1.self_attention.linear_qkv"
    weight = arch.to_canonical(f"{prefix}.weight", state, model).double()
    x = torch.randn(3, 5, model.hidden_size, dtype=torch.float64)
    mixed = x @ weight.T
    if model.qkv_bias:
        mixed = mixed + arch.to_canonical(f"{prefix}.bias", state, model).double()
    # Megatron: view [.., groups, (heads/groups + 2) * d], split into q heads, k, v per group.
    per_group = mixed.view(3, 5, kv_heads, (heads // kv_heads + 2) * head_dim)
    q, k, v = per_group.split([heads // kv_heads * head_dim, head_dim, head_dim], dim=-1)
    q = q.reshape(3, 5, heads, head_dim)
    hf = "model.layers.1.self_attn"

    def project(p: str) -> torch.Tensor:
        out = x @ state[f"{hf}.{p}_proj.weight"].double().T
        return out + state[f"{hf}.{p}_proj.bias"].double() if model.qkv_bias else out
    assert torch.allclose(q, project("q").view(3, 5, heads, head_dim), atol=1e-12)
    assert torch.allclose(k, project("k").view(3, 5, kv_heads, head_dim), atol=1e-12)
    assert torch.allclose(v, project("v").view(3, 5, kv_heads, head_dim), atol=1e-12)


# ---------------------------------------------------------------------------------- (e) export

@pytest.mark.parametrize("case", sorted(CASES))
def test_exported_config_round_trips_and_rebuilds_the_same_model(case):
    arch, model, config, state = canonical_of(case)
    exported = arch.hf_config(model)
    assert arch.model_config(exported) == model
    assert arch.model_config(json.loads(json.dumps(exported))) == model
    fields = {k: v for k, v in exported.items() if k != "model_type"}
    rebuilt_config = transformers.AutoConfig.for_model(exported["model_type"], **fields)
    assert type(rebuilt_config) is type(config)
    rebuilt = transformers.AutoModelForCausalLM.from_config(rebuilt_config).eval()
    hf_state = {}
    for name in arch.hf_to_canonical_names(model):
        hf_state.update(arch.from_canonical(name, arch.to_canonical(name, state, model), model))
    missing, unexpected = rebuilt.load_state_dict(hf_state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    tokens = torch.randint(0, model.vocab_size, (2, 7))
    with torch.no_grad():
        assert torch.equal(rebuilt(tokens).logits, hf_case(case)[1](tokens).logits)


@pytest.mark.parametrize("case", ["qwen2_untied_kv2", "llama_untied_kv2_llama3"])
def test_exported_config_keeps_base_fields_and_updates_derived_ones(case):
    config_dict, _ = hf_case(case)
    arch = architecture_for(config_dict)
    model = arch.model_config(config_dict)
    deeper = ModelConfig(**{**model.__dict__, "num_layers": 3, "rope_theta": 7.0e5})
    exported = arch.hf_config(deeper, base={**config_dict, "bos_token_id": 7})
    assert arch.model_config(exported) == deeper and exported["bos_token_id"] == 7
    assert exported["rope_parameters"]["rope_theta"] == exported["rope_theta"] == 7.0e5
    if "layer_types" in config_dict:
        assert exported["layer_types"] == ["full_attention"] * 3


def test_exported_config_refuses_a_contradicting_base():
    config_dict, _ = hf_case("llama_tied_kv1_smollm2")
    arch = architecture_for(config_dict)
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        arch.hf_config(arch.model_config(config_dict),
                       base={**config_dict, "final_logit_softcapping": 30.0})


# ---------------------------------------------------------------------------------- (f) refusals

def with_fields(case: str, **fields) -> dict:
    """The case's config.json dict with some fields replaced."""
    return {**hf_case(case)[0], **fields}


def test_unsupported_architecture_lists_supported_ones():
    for config in ({"architectures": ["DeepseekV3ForCausalLM"]}, {}):
        with pytest.raises(ValueError, match="LlamaForCausalLM.*MistralForCausalLM.*"
                                             "MixtralForCausalLM.*Qwen2"):
            architecture_for(config)


@pytest.mark.parametrize("case, fields, message", [
    ("mistral_untied_kv1", dict(sliding_window=4096, max_position_embeddings=32768),
     "sliding_window=4096"),
    ("llama_untied_kv2_llama3", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
     "rope_parameters.rope_type='yarn'"),
    ("llama_untied_kv2_llama3", dict(rope_scaling={"type": "linear", "factor": 2.0}),
     "rope_scaling.rope_type='linear'"),
    ("llama_tied_kv1_smollm2", dict(attention_bias=True), "attention_bias=True.*o_proj"),
    ("qwen3_untied_kv1", dict(attention_bias=True), "attention_bias=True"),
    ("llama_tied_kv1_smollm2", dict(mlp_bias=True), "mlp_bias=True"),
    ("qwen2_untied_kv2", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("llama_tied_kv1_smollm2", dict(pretraining_tp=2), "pretraining_tp=2"),
    ("qwen2_untied_kv2", dict(use_sliding_window=True), "use_sliding_window=True"),
    ("qwen3_untied_kv1", dict(layer_types=["full_attention", "sliding_attention"]),
     "layer_types="),
    ("llama_tied_kv1_smollm2", dict(architectures=["Qwen2ForCausalLM"]), "architectures"),
])
def test_unsupported_fields_are_refused_by_name_and_value(case, fields, message):
    config = with_fields(case, **fields)
    with pytest.raises(ValueError, match=message):
        ARCHITECTURES[CASES[case][1]].model_config(config)


def test_mistral_without_sliding_window_key_gets_transformers_default_window():
    config = with_fields("mistral_untied_kv1", max_position_embeddings=32768)
    del config["sliding_window"]
    with pytest.raises(ValueError, match="sliding_window=4096"):
        architecture_for(config).model_config(config)


def test_mis_shaped_tensor_error_names_tensor_and_shapes():
    arch, model, config, state = canonical_of("qwen2_untied_kv2")
    broken = {**state, "model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight'.*"
                                         r"\(16, 64\).*\(32, 64\)"):
        arch.to_canonical("decoder.layers.0.self_attention.linear_qkv.weight", broken, model)
    with pytest.raises(ValueError, match=r"\(3, 64\).*\(250, 64\)"):
        arch.from_canonical("embedding.word_embeddings.weight", torch.zeros(3, 64), model)


def test_missing_tensor_is_named():
    arch, model, config, state = canonical_of("qwen3_tied_kv2_wide_heads")
    partial = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.v_proj.weight"}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight"):
        arch.to_canonical("decoder.layers.1.self_attention.linear_qkv.weight", partial, model)


def test_tensor_the_model_lacks_is_refused():
    arch, model, config, state = canonical_of("llama_tied_kv1_smollm2")
    for name in ("output_layer.weight", "decoder.layers.0.self_attention.linear_qkv.bias",
                 "decoder.layers.2.input_layernorm.weight"):
        with pytest.raises(ValueError, match="not a parameter of this model"):
            arch.to_canonical(name, state, model)
