"""LoRA against HF peft on the same base weights and adapters (fp32, <= 1e-5): log-probs, the
gradient of every adapter matrix after one backward pass, the served (merged) weights against
peft's merge_and_unload, and the base with adapters off, at TP1 and TP2 x PP2. For a dense
Qwen2 and a Qwen2-MoE (a dense first layer, then 4 routed experts beside a gated shared
expert): there the adapters sit on attention, the dense layer's MLP and the shared expert's,
the routed experts stay frozen, as peft's target modules leave transformers' fused experts.
"""

import copy
import dataclasses

import pytest
import torch

from hf_models import hf_state, save_hf_case
from layout_worker import reference_batch
from lora_worker import run_lora_parity
from mcore_rl.config import ModelConfig
from mcore_rl.config.lora import LoraConfig
from mcore_rl.conversion.architectures.hf_tensors import fuse_qkv
from mcore_rl.conversion.hf_to_mcore import model_config_of_hf
from mcore_rl.runtime.model_rank import ModelRank
from world import run_world

TOLERANCE = 1e-5
LAYOUTS = [(1, 1), (2, 2)]
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = {"linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
         "linear_proj": ("self_attn", ("o_proj",)),
         "linear_fc1": ("mlp", ("gate_proj", "up_proj")),
         "linear_fc2": ("mlp", ("down_proj",))}
CASES = {"qwen2": ("Qwen2ForCausalLM", {}),
         "qwen2_moe": ("Qwen2MoeForCausalLM", {"mlp_only_layers": [0]})}
"""case: (architecture, config overrides)."""


def adapted_blocks(layer) -> dict:
    """Megatron's linear -> (its block's Megatron name, the HF module holding its parts) in one
    HF decoder layer: attention, and the dense MLP or an MoE layer's shared expert."""
    mlp = layer.mlp
    blocks = {"linear_qkv": ("self_attention", layer.self_attn),
              "linear_proj": ("self_attention", layer.self_attn)}
    if hasattr(mlp, "shared_expert"):
        mlp_block = ("mlp.shared_experts", mlp.shared_expert)
    elif hasattr(mlp, "gate_proj"):
        mlp_block = ("mlp", mlp)
    else:
        return blocks
    return {**blocks, "linear_fc1": mlp_block, "linear_fc2": mlp_block}


def peft_model(hf_model, generator):
    """peft adapters on a copy of the HF model: one A per fused Megatron linear (q, k and v
    share theirs, as gate and up do), random non-zero B everywhere."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    model = get_peft_model(copy.deepcopy(hf_model), PeftLoraConfig(
        r=LORA.rank, lora_alpha=LORA.alpha, lora_dropout=0.0, target_modules=HF_TARGETS))
    with torch.no_grad():
        for layer in model.base_model.model.model.layers:
            for linear, (_, holder) in adapted_blocks(layer).items():
                modules = [getattr(holder, name) for name in FUSED[linear][1]]
                shared_a = 0.1 * torch.randn(modules[0].lora_A["default"].weight.shape,
                                             generator=generator)
                for module in modules:
                    module.lora_A["default"].weight.copy_(shared_a)
                    module.lora_B["default"].weight.copy_(
                        0.1 * torch.randn(module.lora_B["default"].weight.shape,
                                          generator=generator))
    return model


def canonical(peft, model: ModelConfig, tensor_of) -> dict:
    """Megatron's full adapters (or their gradients) from peft's modules: `tensor_of(linear,
    "A" or "B")` reads one; fused linears take the shared A (its gradient: the sum) and B's
    rows fused as the weight's are."""
    full = {}
    for index, layer in enumerate(peft.base_model.model.model.layers):
        for linear, (block, holder) in adapted_blocks(layer).items():
            modules = [getattr(holder, name) for name in FUSED[linear][1]]
            a = (tensor_of(modules[0], "A") if tensor_of is _weight
                 else sum(tensor_of(module, "A") for module in modules))
            bs = [tensor_of(module, "B") for module in modules]
            b = fuse_qkv(*bs, model) if linear == "linear_qkv" else torch.cat(bs)
            stem = f"decoder.layers.{index}.{block}.{linear}"
            full[f"{stem}.lora_a"] = a
            full[f"{stem}.lora_b"] = b
    return full


def _weight(module, which):
    return getattr(module, f"lora_{which}")["default"].weight.detach().clone()


def _grad(module, which):
    return getattr(module, f"lora_{which}")["default"].weight.grad.clone()


def merged_by_file_name(peft, hf_dir: str) -> dict:
    """peft's merge_and_unload under the names of the HF files (transformers holds a
    Mixture-of-Experts layer's experts fused in memory; they take no adapter, so the file's
    per-expert tensors are the merged ones)."""
    merged = {name.removeprefix("base_model.model."): tensor for name, tensor in
              copy.deepcopy(peft).merge_and_unload().state_dict().items()}
    return {name: merged.get(name, tensor) for name, tensor in hf_state(hf_dir).items()}


def hf_policy_loss(logits, batch):
    """layout_worker.policy_style_loss on HF logits: -logp - 0.1 entropy, mean over real tokens
    after the first; also returns the per-token log-probs (0 at position 0 and padding)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    log_softmax = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = log_softmax.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    real = mask[:, 1:].float()
    loss = ((-logp - 0.1 * entropy) * real).sum() / real.sum()
    return loss, torch.nn.functional.pad(logp * real, (1, 0))


@pytest.fixture(scope="module", params=list(CASES))
def parity(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    hf_dir = str(root / "hf")
    hf_model = save_hf_case(request.param, hf_dir, **CASES[request.param][1])
    model = model_config_of_hf(hf_dir)
    batch = reference_batch(model)
    peft = peft_model(hf_model, torch.Generator().manual_seed(5))
    logits = peft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss, logprobs = hf_policy_loss(logits, batch)
    loss.backward()
    with torch.no_grad(), peft.disable_adapter():
        base_logits = peft(input_ids=batch["input_ids"],
                           attention_mask=batch["attention_mask"]).logits
    reference = {"logprobs": logprobs.detach(), "loss": loss.item(),
                 "base_logprobs": hf_policy_loss(base_logits, batch)[1],
                 "grads": canonical(peft, model, _grad),
                 "merged": merged_by_file_name(peft, hf_dir),
                 "hf_dir": hf_dir, "adapters": canonical(peft, model, _weight)}
    out = root / "results.pt"
    run_world(4, run_lora_parity, hf_dir, LORA, canonical(peft, model, _weight), LAYOUTS, batch,
              str(out))
    return reference, torch.load(out, weights_only=False), model, CASES[request.param][0]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"TP{l[0]}PP{l[1]}")
def test_lora_matches_peft(parity, layout):
    reference, results, model, _ = parity
    got = results[layout]
    mask = reference_batch(model)["attention_mask"].bool()
    for name in ("logprobs", "base_logprobs"):
        difference = (got[name] - reference[name])[mask].abs().max().item()
        print(f"{name}: max difference {difference:.1e}")
        assert difference <= TOLERANCE, name
    assert abs(got["loss"] - reference["loss"]) <= TOLERANCE
    assert got["grads"].keys() == reference["grads"].keys()
    for name, want in reference["grads"].items():
        assert want.abs().max() > 0, name  # every adapter matrix gets a gradient
        difference = (got["grads"][name] - want).abs().max().item()
        print(f"gradient of {name}: max {want.abs().max().item():.2e}, difference {difference:.1e}")
        assert difference <= TOLERANCE * max(1.0, want.abs().max().item()), name
    norm = torch.sqrt(sum(grad.double().square().sum() for grad in reference["grads"].values()))
    assert got["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
    assert all(".lora_" in name for name in got["trained"]) and got["trained"]
    if layout == (1, 1):  # the memory plan counts what the model holds
        from mcore_rl.training.memory_plan import adapter_parameters
        assert got["adapter_elements"] == adapter_parameters(model, LORA)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"TP{l[0]}PP{l[1]}")
def test_served_weights_are_peft_merge(parity, layout):
    """What the engine gets (W + alpha/r B A, shard by shard) is peft's merge_and_unload."""
    from mcore_rl.conversion.architectures import ARCHITECTURES

    reference, results, model, architecture_name = parity
    merged = reference["merged"]
    architecture = ARCHITECTURES[architecture_name]
    served = results[layout]["served"]
    assert not any("lora" in name for name in served)
    for name, tensor in served.items():
        want = architecture.to_canonical(name, merged, model)
        assert (tensor - want).abs().max().item() <= TOLERANCE, name


def test_peft_export_loads_onto_transformers(parity, tmp_path):
    """The adapter export (conversion/peft_adapter.py) of Megatron's full adapters, loaded by
    peft.PeftModel onto the HF base, gives the peft model's log-probs (for the MoE model: its
    shared expert's adapters under transformers' names)."""
    import transformers
    from peft import PeftModel

    from mcore_rl.conversion.architectures import ARCHITECTURES
    from mcore_rl.conversion.peft_adapter import write_peft_adapter

    reference, _, model, architecture_name = parity
    folder = write_peft_adapter(str(tmp_path / "adapter"), reference["adapters"], model, LORA,
                                ARCHITECTURES[architecture_name], reference["hf_dir"])
    base = transformers.AutoModelForCausalLM.from_pretrained(reference["hf_dir"],
                                                             dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, folder).eval()
    batch = reference_batch(model)
    with torch.no_grad():
        logits = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = batch["attention_mask"].bool()
    difference = (hf_policy_loss(logits, batch)[1] - reference["logprobs"])[mask].abs().max()
    assert difference.item() <= TOLERANCE


def test_bad_adapter_settings_are_refused_naming_the_field():
    from mcore_rl.config import ConfigError, load_config, validate_rl

    config = load_config(None, ["actor.lora.enabled=true", "actor.lora.rank=0",
                                "actor.lora.target_modules=[q_proj,qkv_proj]"])
    with pytest.raises(ConfigError) as error:
        validate_rl(config, 1)
    assert "actor.lora.rank=0 must be > 0" in str(error.value)
    assert "actor.lora.target_modules: ['qkv_proj'] are not linears" in str(error.value)
    dropout = load_config(None, ["actor.lora.enabled=true", "actor.lora.dropout=0.1",
                                 "parallel.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"actor.lora.dropout=0.1 with parallel.tensor_model_"):
        validate_rl(dropout, 2)
    assert LoraConfig(target_modules=("q_proj", "down_proj")).megatron_targets() == (
        "linear_qkv", "linear_fc2")
    assert LoraConfig(target_modules=("all-linear",)).megatron_targets() == (
        "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def test_targets_that_adapt_nothing_on_a_moe_model_are_refused_or_named():
    """Issue 63: on a Mixture-of-Experts model without a dense layer or a shared expert the MLP
    targets have no linear to adapt (routed experts take none). Only MLP targets: refused, by
    the rule and by the build; with other targets beside them: the idle ones named."""
    from mcore_rl.config import ParallelConfig
    from mcore_rl.config.model import MoEConfig
    from mcore_rl.models import build_gpt_model

    moe = ModelConfig(moe=MoEConfig(num_experts=4, router_topk=2))
    for targets in (("linear_fc1", "linear_fc2"), ("gate_proj", "up_proj", "down_proj")):
        lora = LoraConfig(enabled=True, target_modules=targets)
        errors = lora.model_errors("actor.lora", moe)
        assert len(errors) == 1, errors
        assert errors[0].startswith(f"actor.lora.target_modules={list(targets)} build no "
                                    "adapter on this model: model.moe.num_experts=4 ")
        assert "shared_expert_ffn_hidden_size=0" in errors[0]
        with pytest.raises(ValueError, match=r"lora\.target_modules=.* build no adapter"):
            build_gpt_model(moe, ParallelConfig(), lora=lora, place=ModelRank.alone())
    mixed = LoraConfig(enabled=True, target_modules=("q_proj", "v_proj", "down_proj"))
    assert mixed.model_errors("sft.lora", moe) == []
    assert mixed.model_warning("sft.lora", moe).startswith(
        "sft.lora.target_modules: ['down_proj'] adapt nothing on this model (model.moe.")
    mlp_only = LoraConfig(enabled=True, target_modules=("linear_fc1", "linear_fc2"))
    reached = [ModelConfig(), dataclasses.replace(moe, moe=dataclasses.replace(
        moe.moe, dense_layers=(0,))), dataclasses.replace(moe, moe=dataclasses.replace(
            moe.moe, shared_expert_ffn_hidden_size=64))]
    for model in reached:
        assert mlp_only.model_errors("actor.lora", model) == []
        assert mlp_only.model_warning("actor.lora", model) is None
    everything = LoraConfig(enabled=True, target_modules=("all-linear",))
    assert everything.model_errors("actor.lora", moe) == []
    assert everything.model_warning("actor.lora", moe) is None
    assert dataclasses.replace(mlp_only, enabled=False).model_errors("actor.lora", moe) == []


def test_adapters_resume_only_onto_their_base(tmp_path):
    from mcore_rl.checkpoint.base_identity import base_identity
    from mcore_rl.config import InitConfig
    from mcore_rl.training.checkpointer import compatibility_problems

    first, second = tmp_path / "base_a", tmp_path / "base_b"
    for folder, value in ((first, 1.0), (second, 2.0)):
        folder.mkdir()
        torch.save(torch.full((4,), value), folder / "weights.pt")
    layout = {"world_size": 1}
    trained_on = base_identity(InitConfig(hf_path=str(first)), 0, LORA)
    marker = {"roles": ["actor"], "layout": layout, "bases": {"actor": trained_on}}
    path = str(tmp_path / "step_00000002")
    assert compatibility_problems(path, marker, ["actor"], layout, {"actor": trained_on}) == []
    (first / "README.md").write_text("edited after download")  # not part of the identity
    assert base_identity(InitConfig(hf_path=str(first)), 0, LORA) == trained_on
    other = base_identity(InitConfig(hf_path=str(second)), 0, LORA)
    [problem] = compatibility_problems(path, marker, ["actor"], layout, {"actor": other})
    assert f"trained on the base {first}" in problem and f"this job's base is {second}" in problem
    rescaled = base_identity(InitConfig(hf_path=str(first)), 0,
                             dataclasses.replace(LORA, alpha=32.0))
    [problem] = compatibility_problems(path, marker, ["actor"], layout, {"actor": rescaled})
    assert problem == ("step_00000002: its actor adapters are rank 4, alpha 8, targets "
                       "linear_qkv, linear_proj, linear_fc1, linear_fc2, this job's are rank 4, "
                       "alpha 32, targets linear_qkv, linear_proj, linear_fc1, linear_fc2")
    [problem] = compatibility_problems(path, marker, ["actor"], layout, {})
    assert problem == "step_00000002: its actor trains adapters, this job's every weight"
