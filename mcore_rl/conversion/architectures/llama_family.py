"""The mapping shared by every Llama-family HF architecture (Llama, Qwen2, Qwen3, Mistral).

Why one core with thin per-architecture files
---------------------------------------------
Llama 2/3, SmolLM2, Mistral, Qwen2 and Qwen3 are one network with a few switches (QKV bias,
QK-norm) and differ mostly in their config.json: defaults, field spellings and fields that would
change the math (sliding windows, o_proj bias, soft-capping, other RoPE variants). Their tensor
names are identical. So this module holds the whole mapping once, and each architecture file only
states its defaults, its switches and what it refuses. A field we cannot reproduce is refused
loudly, naming the field and its value: converting such a checkpoint "successfully" would give a
model that is silently different from the original.

What is mapped
--------------
config.json (a plain dict) <-> `ModelConfig`, and HF tensors <-> the canonical full layout of
`mcore_rl.param_layout.sharding` (Megatron names, TP=1, PP=1, global layer indices, unpadded vocab).
Mixture-of-Experts members (Qwen3-MoE, Qwen2-MoE, Mixtral; `HfMoeLayout`) name their router
and per-expert projections differently; each expert's gate and up projections fuse into its
``linear_fc1`` like the dense MLP's. Only three canonical tensors are not a plain rename:

* ``linear_qkv`` (weight and Qwen2 bias): for each KV group g, [the q heads of group g, k head g,
  v head g], each head ``head_dim`` rows, exactly the rows Megatron's forward splits per group.
* ``linear_fc1``: cat([gate_proj, up_proj]).
* ``output_layer``: exists only when embeddings are untied (HF ``lm_head.weight``).

HF Llama-family q/k weights are already in the rotate-half order Megatron's RoPE uses (HF
permuted them when converting from Meta's interleaved format), so no row permutation is applied.

This module is pure: torch only, no torch.distributed, no Megatron, no transformers.

Where the parts live
--------------------
This module holds `Architecture` (the config.json translation and the tensor methods) and the
checks that the two directions agree. Its parts live in siblings, one concern each:
`refusals.py` (unsupported config fields), `hf_tensors.py` (HF tensor names, shapes and the
q/k/v and gate/up fusions) and `rope.py` (the RoPE spellings of config.json).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from mcore_rl.config.model import ModelConfig, MoEConfig
from mcore_rl.param_layout import sharding
from mcore_rl.param_layout.sharding import ShardKind

from .hf_tensors import (_HF_ROTARY_BUFFER, HfMoeLayout, _canonical_shape, _canonical_shapes,
                         _fresh, _gather_sources, _hf_shapes, _hf_sources, _hf_sources_checked,
                         fuse_qkv, split_qkv)
from .refusals import COMMON_REFUSALS, Refusal
from .rope import read_rope, write_rope

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
    "chat_template.jinja",
)
"""Files next to the weights that a converted checkpoint must carry along unchanged."""

EXPORT_DTYPE = "float32"
"""dtype written into an exported config.json when the base config names none."""

# --------------------------------------------------------------------------------------------
# The architecture
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Architecture:
    """One HF Llama-family architecture: its config translation and its tensor mapping.

    The tensor mapping is the same for every member; the fields below carry the differences.
    """

    name: str
    """HF class name as in config.json ``architectures[0]``, e.g. "LlamaForCausalLM"."""

    model_type: str
    """config.json ``model_type`` (the transformers AutoConfig key), e.g. "llama"."""

    defaults: Mapping[str, Any]
    """transformers' defaults for keys a config.json may omit (they decide the math)."""

    refusals: tuple[Refusal, ...] = COMMON_REFUSALS
    """Fields whose unsupported values make `model_config` refuse the config."""

    export_fields: Mapping[str, Any] = field(default_factory=dict)
    """Constant config.json values written on export (they override a base config's)."""

    uses_layer_types: bool = False
    """True when the config class has ``layer_types`` (written as all "full_attention")."""

    qkv_bias: bool = False
    """The q/k/v projections carry a bias (Qwen2)."""

    qk_norm: bool = False
    """Queries and keys are RMS-normalised per head before RoPE (Qwen3)."""

    moe: Optional[HfMoeLayout] = None
    """The Mixture-of-Experts layout (None: a dense architecture)."""

    tokenizer_files: tuple[str, ...] = TOKENIZER_FILES
    """Files next to the weights that travel with a checkpoint unchanged."""

    # ---------------------------------------------------------------------------- config.json

    def model_config(self, hf_config: Mapping[str, Any]) -> ModelConfig:
        """Translate a config.json dict into a `ModelConfig`; ValueError naming the field and
        value for anything that would change the math and is not supported.

        Omitted keys take transformers' defaults for this architecture; ``num_key_value_heads``
        None means as many as the query heads. ``attention_dropout`` is ignored: RL training
        and generation run without dropout. ``make_vocab_size_divisible_by`` is a layout choice
        HF does not store; it keeps the `ModelConfig` default.
        """
        self._check_architecture_name(hf_config)
        resolved = {**self.defaults, **hf_config}
        errors = [msg for rule in self.refusals if (msg := rule.error(resolved)) is not None]
        if errors:
            raise ValueError(f"{self.name}: unsupported config: " + "; ".join(errors))
        model = self._model_from_resolved(resolved)
        problems = model.check()
        if problems:
            raise ValueError(f"{self.name}: invalid config: " + "; ".join(problems))
        return model

    def _check_architecture_name(self, hf_config: Mapping[str, Any]) -> None:
        """ValueError when the config names a different architecture than this one."""
        names = hf_config.get("architectures") or [self.name]
        if names[0] != self.name:
            raise ValueError(f"architectures[0]={names[0]!r} is not {self.name!r}")

    def _model_from_resolved(self, resolved: Mapping[str, Any]) -> ModelConfig:
        """The `ModelConfig` for a config whose defaults are applied and refusals passed."""
        heads = int(resolved["num_attention_heads"])
        kv_heads = resolved.get("num_key_value_heads")
        head_dim = resolved.get("head_dim")
        theta, scaling = read_rope(resolved)
        return ModelConfig(
            num_layers=int(resolved["num_hidden_layers"]),
            hidden_size=int(resolved["hidden_size"]),
            ffn_hidden_size=int(resolved["intermediate_size"]),
            num_attention_heads=heads,
            num_kv_heads=heads if kv_heads is None else int(kv_heads),
            head_dim=None if head_dim is None else int(head_dim),
            vocab_size=int(resolved["vocab_size"]),
            max_position_embeddings=int(resolved["max_position_embeddings"]),
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(resolved["rms_norm_eps"]),
            tie_embeddings=bool(resolved.get("tie_word_embeddings", False)),
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            moe=self._moe_from_resolved(resolved),
        )

    def _moe_from_resolved(self, resolved: Mapping[str, Any]) -> MoEConfig:
        """The MoE config of a resolved config.json (dense architectures: none). A layer is MoE
        unless listed in mlp_only_layers or off the decoder_sparse_step grid (transformers'
        rule: (layer + 1) % step == 0)."""
        layout = self.moe
        if layout is None:
            return MoEConfig()
        experts = next(int(resolved[key]) for key in layout.num_experts_keys if key in resolved)
        dense: tuple[int, ...] = ()
        if layout.sparse_step_keys:
            step = int(resolved.get("decoder_sparse_step") or 1)
            only_mlp = set(resolved.get("mlp_only_layers") or ())
            dense = tuple(layer for layer in range(int(resolved["num_hidden_layers"]))
                          if layer in only_mlp or (layer + 1) % step)
        return MoEConfig(
            num_experts=experts,
            ffn_hidden_size=int(resolved[layout.expert_ffn_key]),
            router_topk=int(resolved["num_experts_per_tok"]),
            normalize_topk=(bool(resolved.get(layout.normalize_key))
                            if layout.normalize_key else True),
            dense_layers=dense,
            shared_expert_ffn_hidden_size=(int(resolved["shared_expert_intermediate_size"])
                                           if layout.shared_expert else 0),
            shared_expert_gate=layout.shared_expert)

    def hf_config(self, model: ModelConfig, base: Optional[Mapping[str, Any]] = None) -> dict:
        """config.json for `model`: `base` (the original HF config, if known, for token ids and
        other fields we do not model) with every field derived from `model` set.

        ``model_config(hf_config(m)) == m`` for every m that `model_config` returns (it sets
        ``num_kv_heads``; ``make_vocab_size_divisible_by`` is not stored in HF configs). RoPE is
        written both as transformers-5 ``rope_parameters`` and as the older ``rope_theta`` /
        ``rope_scaling`` so readers on either side of that change get the same frequencies.
        """
        config = dict(base or {})
        config.update(architectures=[self.name], model_type=self.model_type)
        config.update(self._shape_fields(model))
        config.update(self._moe_fields(model))
        self._set_head_dim(model, config)
        config.update(write_rope(model))
        config.update(self.export_fields)
        if self.uses_layer_types:
            config["layer_types"] = ["full_attention"] * model.num_layers
        else:
            config.pop("layer_types", None)
        if "dtype" not in config and "torch_dtype" not in config:
            config["dtype"] = EXPORT_DTYPE
        self._check_round_trip(model, config)
        return config

    def _shape_fields(self, model: ModelConfig) -> dict[str, Any]:
        """config.json fields that state `model`'s shape and numerics."""
        return {
            "hidden_size": model.hidden_size,
            "intermediate_size": model.ffn_hidden_size,
            "num_hidden_layers": model.num_layers,
            "num_attention_heads": model.num_attention_heads,
            "num_key_value_heads": model.kv_heads,
            "vocab_size": model.vocab_size,
            "max_position_embeddings": model.max_position_embeddings,
            "rms_norm_eps": model.norm_eps,
            "tie_word_embeddings": model.tie_embeddings,
            "hidden_act": "silu",
        }

    def _moe_fields(self, model: ModelConfig) -> dict[str, Any]:
        """config.json fields of the MoE layers (dense layers as mlp_only_layers)."""
        layout, moe = self.moe, model.moe
        if layout is None:
            return {}
        fields = {layout.num_experts_keys[0]: moe.num_experts,
                  "num_experts_per_tok": moe.router_topk,
                  layout.expert_ffn_key: moe.expert_ffn(model.ffn_hidden_size)}
        if layout.normalize_key:
            fields[layout.normalize_key] = moe.normalize_topk
        if layout.sparse_step_keys:
            fields.update(decoder_sparse_step=1, mlp_only_layers=sorted(moe.dense_layers))
        if layout.shared_expert:
            fields["shared_expert_intermediate_size"] = moe.shared_expert_ffn_hidden_size
        return fields

    def _set_head_dim(self, model: ModelConfig, config: dict) -> None:
        """Write head_dim, or leave it out when the model derives it (hidden/heads) and so does
        transformers for a config without it (Qwen3 defaults to 128, so it always gets one)."""
        if model.head_dim is None and self.defaults.get("head_dim") is None:
            config.pop("head_dim", None)
        else:
            config["head_dim"] = model.kv_channels

    def _check_round_trip(self, model: ModelConfig, config: dict) -> None:
        """ValueError if `config` does not read back as `model` (a base config field that
        contradicts it, or a model this architecture cannot express)."""
        if model.moe.enabled != (self.moe is not None):
            raise ValueError(f"{self.name} is {'a' if self.moe else 'not a'} Mixture-of-Experts "
                             f"architecture; the model has model.moe.num_experts="
                             f"{model.moe.num_experts}")
        if model.qkv_bias != self.qkv_bias or model.qk_norm != self.qk_norm:
            raise ValueError(f"{self.name} has qkv_bias={self.qkv_bias}, qk_norm={self.qk_norm};"
                             f" the model has qkv_bias={model.qkv_bias}, qk_norm={model.qk_norm}")
        read_back = self.model_config(config)
        if _hf_visible(read_back) != _hf_visible(model):
            raise ValueError(f"{self.name}: exported config reads back as {read_back}, "
                             f"not {model}")

    # ---------------------------------------------------------------------------- tensors

    def hf_to_canonical_names(self, model: ModelConfig) -> dict[str, list[str]]:
        """Every canonical tensor of `model` (LM head) -> the HF tensors that build it, in
        fusion order. Each HF tensor of the checkpoint appears exactly once (a tied model has
        no ``lm_head.weight``)."""
        return {name: list(_hf_sources(name, self.moe)) for name in _canonical_shapes(model)}

    def hf_shapes(self, canonical_name: str, model: ModelConfig) -> dict[str, tuple]:
        """The HF tensors that build canonical `canonical_name` -> their expected shapes."""
        name = sharding.canonical_name(canonical_name)
        return dict(zip(_hf_sources_checked(name, model, self.moe), _hf_shapes(name, model)))

    def is_redundant_hf_name(self, hf_name: str, model: ModelConfig) -> bool:
        """True for HF state-dict entries that carry no information of their own: the tied
        ``lm_head.weight`` some checkpoints still store, and old ``rotary_emb.inv_freq``
        buffers (recomputed from the config)."""
        if hf_name == "lm_head.weight":
            return model.tie_embeddings
        return bool(_HF_ROTARY_BUFFER.match(hf_name))

    def to_canonical(self, canonical_name: str, hf_tensors: Mapping[str, torch.Tensor],
                     model: ModelConfig) -> torch.Tensor:
        """Build canonical tensor `canonical_name` from `hf_tensors` (which may hold more than
        its sources). ValueError naming any missing HF tensor, or a mis-shaped one with both
        shapes. The result is contiguous."""
        name = sharding.canonical_name(canonical_name)
        sources = _hf_sources_checked(name, model, self.moe)
        tensors = _gather_sources(name, sources, _hf_shapes(name, model), hf_tensors)
        kind = sharding.shard_kind(name)
        if kind is ShardKind.QKV:
            return fuse_qkv(*tensors, model)
        if kind is ShardKind.GATE_UP:
            return torch.cat(tensors, dim=0)
        return tensors[0].contiguous()

    def from_canonical(self, canonical_name: str, tensor: torch.Tensor,
                       model: ModelConfig) -> dict[str, torch.Tensor]:
        """The HF tensors held in canonical tensor `canonical_name`, by HF name; contiguous,
        bit-identical to what `to_canonical` consumed, and never sharing storage with each
        other. ValueError naming the tensor and both shapes when it is mis-shaped."""
        name = sharding.canonical_name(canonical_name)
        sources = _hf_sources_checked(name, model, self.moe)
        expected = _canonical_shape(name, model)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"canonical tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {expected}")
        kind = sharding.shard_kind(name)
        if kind is ShardKind.QKV:
            parts = split_qkv(tensor, model)
        elif kind is ShardKind.GATE_UP:
            parts = tuple(_fresh(half) for half in tensor.chunk(2, dim=0))
        else:
            parts = (tensor.contiguous(),)
        return dict(zip(sources, parts))


def _hf_visible(model: ModelConfig) -> ModelConfig:
    """`model` with what config.json cannot tell apart normalised: None KV heads or head_dim
    versus their derived values, the vocab padding multiple (a layout choice), and the MoE
    training options (load-balancing losses, router precision, a frozen router)."""
    moe = model.moe
    if moe.enabled:
        untrained = MoEConfig()
        moe = dataclasses.replace(
            moe, ffn_hidden_size=moe.expert_ffn(model.ffn_hidden_size),
            dense_layers=tuple(sorted(moe.dense_layers)),
            **{name: getattr(untrained, name) for name in (
                "aux_loss_coeff", "z_loss_coeff", "router_dtype", "freeze_router")})
    return ModelConfig(**{**model.__dict__, "num_kv_heads": model.kv_heads,
                          "head_dim": model.kv_channels, "make_vocab_size_divisible_by": 1,
                          "moe": moe})
