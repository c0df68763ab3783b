"""peft adapters that start where an mcore_rl job's start, for the jobs' LoRA tests (SFT, DPO):
the same targets, rank, alpha and starting A, so torch Adam on peft's adapters is the reference
for Megatron's distributed optimizer on the job's."""

import torch

LORA_TARGETS = {"o_proj": "self_attention.linear_proj", "down_proj": "mlp.linear_fc2"}
"""The LoRA jobs' targets: linears Megatron does not fuse, so peft's adapters are
the same parameters and Adam moves them the same way."""
LORA_RANK, LORA_ALPHA, SEED = 4, 8.0, 1234


def peft_policy(model, modules_to_save=None):
    """peft adapters on `model` starting where the Megatron job's start (A as
    models/lora.initial_lora_a draws it for runtime.seed, B = 0); modules_to_save train whole
    (a reward model's score head)."""
    from peft import LoraConfig, get_peft_model

    from mcore_rl.models.lora import initial_lora_a

    model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA,
                                             lora_dropout=0.0, target_modules=list(LORA_TARGETS),
                                             modules_to_save=modules_to_save))
    with torch.no_grad():
        for index, layer in enumerate(model.base_model.model.model.layers):
            for hf_name, megatron_name in LORA_TARGETS.items():
                module = getattr(layer.self_attn if hf_name == "o_proj" else layer.mlp, hf_name)
                a = module.lora_A["default"].weight
                a.copy_(initial_lora_a(f"decoder.layers.{index}.{megatron_name}.lora_a",
                                       LORA_RANK, a.shape[1], SEED))
                module.lora_B["default"].weight.zero_()
    return model


def lora_overrides(section: str) -> list[str]:
    """The job's settings matching `peft_policy`."""
    return [f"{section}.lora.enabled=true", f"{section}.lora.rank={LORA_RANK}",
            f"{section}.lora.alpha={LORA_ALPHA}",
            f"{section}.lora.target_modules=[{','.join(LORA_TARGETS)}]", f"runtime.seed={SEED}"]


def assert_same_adapter(adapter_dir, trained_peft_model, hf_init) -> None:
    """The job's peft adapter folder holds the reference's trained adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_init, torch_dtype=torch.float32)
    exported = PeftModel.from_pretrained(base, adapter_dir)
    expected = {name: tensor for name, tensor in trained_peft_model.state_dict().items()
                if "lora_" in name}
    got = exported.state_dict()
    assert expected and expected.keys() == {name for name in got if "lora_" in name}
    for name, tensor in expected.items():
        assert torch.allclose(got[name], tensor, atol=1e-5), name
