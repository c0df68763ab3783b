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
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from mcore_rl.config.model import ModelConfig, MoEConfig, RopeScalingConfig
from mcore_rl.param_layout import sharding
from mcore_rl.param_layout.sharding import ShardKind

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
    "chat_template.jinja",
)
"""Files next to the weights that a converted checkpoint must carry along unchanged."""

DEFAULT_ROPE_THETA = 10000.0
"""transformers' RoPE base when a config names none (the same for all four architectures)."""

EXPORT_DTYPE = "float32"
"""dtype written into an exported config.json when the base config names none."""

# --------------------------------------------------------------------------------------------
# Refusals: config fields that change the math and are not supported
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """One config field whose value must pass `accepts`, else the conversion is refused."""

    field: str
    """config.json key."""

    accepts: Callable[[Any, Mapping[str, Any]], bool]
    """(value, whole resolved config) -> True when the value is supported."""

    why: str
    """What the value would change, for the error message."""

    def error(self, resolved: Mapping[str, Any]) -> Optional[str]:
        """The refusal message for this config, or None when the value is supported. A missing
        key counts as None (the architecture's defaults have already been applied)."""
        value = resolved.get(self.field)
        if self.accepts(value, resolved):
            return None
        return f"{self.field}={value!r} is not supported: {self.why}"


def must_be(field_name: str, supported: Any, why: str) -> Refusal:
    """Refuse any value but `supported` (a missing key or None counts as supported when
    `supported` is falsy, as transformers treats them)."""
    def accepts(value: Any, _resolved: Mapping[str, Any]) -> bool:
        return value == supported or (not supported and value is None)
    return Refusal(field_name, accepts, why)


def must_be_none(field_name: str, why: str) -> Refusal:
    """Refuse any value but None / a missing key."""
    return Refusal(field_name, lambda value, _resolved: value is None, why)


def _all_full_attention(value: Any, _resolved: Mapping[str, Any]) -> bool:
    """True when `layer_types` is absent or lists only full-attention layers."""
    return value is None or all(kind == "full_attention" for kind in value)


def _at_most_one(value: Any, _resolved: Mapping[str, Any]) -> bool:
    """True for None, 0 or 1 (pretraining_tp > 1 splits the projections differently)."""
    return value is None or value <= 1


COMMON_REFUSALS = (
    must_be("hidden_act", "silu", "the Megatron model uses SwiGLU (SiLU-gated) MLPs only"),
    Refusal("layer_types", _all_full_attention,
            "only full attention is supported (sliding-window layers would attend differently)"),
    must_be_none("attn_logit_softcapping", "attention logit soft-capping is not implemented"),
    must_be_none("final_logit_softcapping", "final logit soft-capping is not implemented"),
    Refusal("pretraining_tp", _at_most_one,
            "transformers computes the projections in slices that round differently"),
)
"""Refusals that hold for every Llama-family architecture."""

# --------------------------------------------------------------------------------------------
# Tensor names
# --------------------------------------------------------------------------------------------

_LAYER_SOURCES: dict[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "self_attention.linear_qkv.weight": (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attention.linear_qkv.bias": (
        "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
"""Canonical per-layer suffix (after ``decoder.layers.{i}.``) -> HF suffixes (after
``model.layers.{i}.``), in fusion order."""

_GLOBAL_SOURCES: dict[str, tuple[str, ...]] = {
    sharding.EMBEDDING: ("model.embed_tokens.weight",),
    sharding.FINAL_NORM: ("model.norm.weight",),
    sharding.OUTPUT_LAYER: ("lm_head.weight",),
}
"""Canonical names outside the layers -> HF names."""

@dataclass(frozen=True)
class HfMoeLayout:
    """Where an HF Mixture-of-Experts architecture keeps its MoE tensors and config fields."""

    block: str = "mlp"
    """The MoE module under ``model.layers.{i}.`` (Mixtral: block_sparse_moe)."""

    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Each expert's gate, up and down projection names (Mixtral: w1, w3, w2)."""

    num_experts_keys: tuple[str, ...] = ("num_experts", "num_local_experts")
    """config.json keys of the expert count; the first present wins, the first is written."""

    expert_ffn_key: str = "moe_intermediate_size"
    """config.json key of the experts' FFN width (Mixtral: intermediate_size)."""

    normalize_key: Optional[str] = "norm_topk_prob"
    """config.json key of the top-k renormalisation; None: always renormalised (Mixtral)."""

    sparse_step_keys: bool = True
    """Dense layers come from decoder_sparse_step and mlp_only_layers (Qwen-MoE)."""

    shared_expert: bool = False
    """An always-on shared expert with a sigmoid gate (Qwen2-MoE)."""

    def layer_sources(self, suffix: str) -> Optional[tuple[str, ...]]:
        """The HF suffixes (after ``model.layers.{i}.``) of canonical MoE suffix `suffix`, or
        None when it is not an MoE tensor."""
        gate, up, down = self.projections
        expert = _CANONICAL_EXPERT.match(suffix)
        if expert:
            index, linear = expert.groups()
            names = (gate, up) if linear == "linear_fc1" else (down,)
            return tuple(f"{self.block}.experts.{index}.{name}.weight" for name in names)
        return {"mlp.router.weight": (f"{self.block}.gate.weight",),
                "mlp.shared_experts.gate_weight": ("mlp.shared_expert_gate.weight",),
                "mlp.shared_experts.linear_fc1.weight": ("mlp.shared_expert.gate_proj.weight",
                                                         "mlp.shared_expert.up_proj.weight"),
                "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_expert.down_proj.weight",),
                }.get(suffix)


_CANONICAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_CANONICAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_HF_ROTARY_BUFFER = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


@functools.lru_cache(maxsize=16)
def _canonical_shapes(model: ModelConfig) -> dict[str, tuple]:
    """`sharding.canonical_param_shapes` for the LM head, cached (it is asked once per tensor)."""
    return sharding.canonical_param_shapes(model, head="lm")


def _canonical_shape(name: str, model: ModelConfig) -> tuple:
    """Shape of canonical tensor `name`; ValueError when this model has no such tensor."""
    shapes = _canonical_shapes(model)
    if name not in shapes:
        raise ValueError(f"{name!r} is not a parameter of this model with an HF counterpart "
                         f"(layers={model.num_layers}, qkv_bias={model.qkv_bias}, "
                         f"qk_norm={model.qk_norm}, tie_embeddings={model.tie_embeddings})")
    return shapes[name]


def _hf_sources(name: str, moe: Optional[HfMoeLayout] = None) -> tuple[str, ...]:
    """The HF tensor names that make up canonical tensor `name`, in fusion order."""
    match = _CANONICAL_LAYER.match(name)
    if match:
        layer, suffix = match.groups()
        sources = (moe and moe.layer_sources(suffix)) or _LAYER_SOURCES[suffix]
        return tuple(f"model.layers.{layer}.{hf}" for hf in sources)
    return _GLOBAL_SOURCES[name]


def _hf_shapes(name: str, model: ModelConfig) -> tuple[tuple, ...]:
    """Expected shape of each HF source of canonical tensor `name` (same order as the sources)."""
    shape = _canonical_shape(name, model)
    kind = sharding.shard_kind(name)
    rest, head_dim = shape[1:], model.kv_channels
    if kind is ShardKind.QKV:
        q_rows, kv_rows = model.num_attention_heads * head_dim, model.kv_heads * head_dim
        return (q_rows, *rest), (kv_rows, *rest), (kv_rows, *rest)
    if kind is ShardKind.GATE_UP:
        return ((shape[0] // 2, *rest),) * 2
    return (shape,)


# --------------------------------------------------------------------------------------------
# Tensor fusion
# --------------------------------------------------------------------------------------------

def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             model: ModelConfig) -> torch.Tensor:
    """Megatron's TP=1 fused QKV rows from HF q/k/v (weights [rows, H] or biases [rows]): per KV
    group g, the group's q heads, then k head g, then v head g."""
    groups, rest = model.kv_heads, q.shape[1:]
    per_group = [q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest),
                 v.reshape(groups, -1, *rest)]
    return torch.cat(per_group, dim=1).reshape(-1, *rest).contiguous()


def split_qkv(fused: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, ...]:
    """Inverse of `fuse_qkv`: (q, k, v), each a fresh contiguous tensor."""
    head_dim, q_rows = model.kv_channels, model.heads_per_kv_group * model.kv_channels
    rest = fused.shape[1:]
    per_group = fused.reshape(model.kv_heads, q_rows + 2 * head_dim, *rest)
    parts = per_group.split([q_rows, head_dim, head_dim], dim=1)
    return tuple(_fresh(part).reshape(-1, *rest) for part in parts)


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that shares no storage with `tensor` (safetensors refuses tensors that
    share memory, and split halves of one tensor would)."""
    return tensor.clone(memory_format=torch.contiguous_format)


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


def _hf_sources_checked(name: str, model: ModelConfig,
                        moe: Optional[HfMoeLayout]) -> tuple[str, ...]:
    """`_hf_sources` after checking that `model` has canonical tensor `name`."""
    _canonical_shape(name, model)
    return _hf_sources(name, moe)


def _gather_sources(name: str, sources: tuple[str, ...], shapes: tuple[tuple, ...],
                    hf_tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The HF source tensors of canonical `name`, checked for presence, shape and one dtype."""
    missing = [source for source in sources if source not in hf_tensors]
    if missing:
        raise ValueError(f"missing HF tensor(s) {missing} needed for canonical {name!r}")
    tensors = [hf_tensors[source] for source in sources]
    for source, tensor, shape in zip(sources, tensors, shapes):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"HF tensor {source!r} has shape {tuple(tensor.shape)}, "
                             f"expected {shape} (for canonical {name!r})")
    dtypes = {tensor.dtype for tensor in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"HF tensors {list(sources)} mix dtypes {sorted(map(str, dtypes))}")
    return tensors


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


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------

_LLAMA3_FACTORS = ("factor", "low_freq_factor", "high_freq_factor")


def _rope_dict(resolved: Mapping[str, Any]) -> tuple[str, dict]:
    """(field name, RoPE dict) as transformers 5 picks it: legacy ``rope_scaling`` wins over
    ``rope_parameters``; a dict nested under "full_attention" is unwrapped."""
    source = "rope_scaling" if resolved.get("rope_scaling") else "rope_parameters"
    params = dict(resolved.get(source) or {})
    nested = set(params) & {"full_attention", "sliding_attention"}
    if nested == {"full_attention"} and len(params) == 1:
        return f"{source}.full_attention", dict(params["full_attention"])
    if nested:
        raise ValueError(f"{source} nested by layer type {sorted(params)} is not supported: "
                         "only one RoPE for all (full-attention) layers is")
    return source, params


def read_rope(resolved: Mapping[str, Any]) -> tuple[float, Optional[RopeScalingConfig]]:
    """(rope theta, Llama-3 scaling or None) from a config in any of the spellings transformers
    accepts: top-level ``rope_theta``, v5 ``rope_parameters`` or legacy ``rope_scaling``.
    ValueError for RoPE variants we do not implement (linear, dynamic, yarn, longrope, ...)."""
    source, params = _rope_dict(resolved)
    theta = params.get("rope_theta") or resolved.get("rope_theta") or DEFAULT_ROPE_THETA
    partial = params.get("partial_rotary_factor", resolved.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported: RoPE is applied "
                         "to the whole head")
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"{source}.rope_type={rope_type!r} is not supported: only 'default' and "
                         "'llama3' RoPE are implemented")
    missing = [key for key in _LLAMA3_FACTORS if params.get(key) is None]
    if missing:
        raise ValueError(f"{source} with rope_type 'llama3' lacks {missing}")
    original = (params.get("original_max_position_embeddings")
                or resolved["max_position_embeddings"])
    scaling = RopeScalingConfig(factor=float(params["factor"]),
                                low_freq_factor=float(params["low_freq_factor"]),
                                high_freq_factor=float(params["high_freq_factor"]),
                                original_max_position_embeddings=int(original))
    return float(theta), scaling


def write_rope(model: ModelConfig) -> dict[str, Any]:
    """config.json RoPE fields for `model`, in the v5 and the legacy spelling alike."""
    scaling = model.rope_scaling
    legacy = None
    if scaling is not None:
        legacy = {"rope_type": "llama3", "factor": scaling.factor,
                  "low_freq_factor": scaling.low_freq_factor,
                  "high_freq_factor": scaling.high_freq_factor,
                  "original_max_position_embeddings": scaling.original_max_position_embeddings}
    parameters = {"rope_type": "default", **(legacy or {}), "rope_theta": model.rope_theta}
    return {"rope_parameters": parameters, "rope_theta": model.rope_theta,
            "rope_scaling": legacy}
