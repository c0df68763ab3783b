"""One rank of the LoRA parity world (tests/test_lora.py): at each layout, build the model with
adapters, load an HF base and given adapters, score a batch, take the gradient of a policy-style
loss, and save on rank 0 the log-probs, the full adapter gradients, the merged (served) weights
and the log-probs with adapters off."""

from __future__ import annotations

import torch
import torch.distributed as dist

from conversion_worker import _set_layout
from layout_worker import MICRO_BATCH, _gather_to_rank0, _merged_weights, policy_style_loss
from mcore_rl.config import InitConfig, OptimizerConfig, ParallelConfig
from mcore_rl.config.lora import LoraConfig
from mcore_rl.conversion.hf_to_mcore import model_config_of_hf
from mcore_rl.models import build_gpt_model
from mcore_rl.models.lora import (adapter_tensors, adapters_disabled, gather_full_adapters,
                                  served_parameters)
from mcore_rl.models.pretrained import load_initial_weights
from mcore_rl.param_layout import sharding
from mcore_rl.training import compute_outputs, make_trainable, shard_for_data_parallel, train_step

# lr 0 and a clipping threshold no norm reaches: the step leaves the weights alone and the
# gradients as computed, and still reports the gradient norm (each TP shard counted once).
FROZEN_STEP = OptimizerConfig(lr=0.0, clip_grad=1e9, use_distributed_optimizer=False)


@torch.no_grad()
def load_adapters(module, full: dict, model) -> None:
    """Copy this rank's shards of the full adapters (global names) into the stage."""
    from megatron.core import parallel_state as ps

    tp_size, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    pp_size, pp_rank = (ps.get_pipeline_model_parallel_world_size(),
                        ps.get_pipeline_model_parallel_rank())
    for name, param in adapter_tensors(module).items():
        tensor = full[sharding.to_global_name(name, pp_rank, model, pp_size)]
        param.copy_(sharding.split_adapter(name, tensor, tp_size, tp_rank))


def run_lora_parity(hf_dir: str, lora: LoraConfig, adapters: dict, layouts: list, batch: dict,
                    out_path: str) -> None:
    from megatron.core import parallel_state as ps

    from mcore_rl.runtime import start_process_group

    start_process_group(timeout_minutes=3)
    model = model_config_of_hf(hf_dir)
    results = {}
    for tp, pp in layouts:
        place = _set_layout(tp, pp)
        parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  sequence_parallel=model.moe.enabled and tp > 1)
        module = build_gpt_model(model, parallel, "fp32", lora=lora, seed=3, place=place)
        assert load_initial_weights(module, InitConfig(hf_path=hf_dir), model)
        trained = sorted(name for name, p in module.named_parameters() if p.requires_grad)
        load_adapters(module, adapters, model)
        local = shard_for_data_parallel(batch, ps.get_data_parallel_rank(),
                                        ps.get_data_parallel_world_size())
        trainable = make_trainable(module, FROZEN_STEP, "fp32")
        outputs = compute_outputs(trainable.chunks, local, MICRO_BATCH, "lm", model.vocab_size)
        with adapters_disabled(module):
            base = compute_outputs(trainable.chunks, local, MICRO_BATCH, "lm", model.vocab_size)
        metrics = train_step(trainable, local, MICRO_BATCH, policy_style_loss, "lm",
                             model.vocab_size)
        grads = gather_full_adapters({name: param.main_grad for name, param in
                                      adapter_tensors(module).items()}, model, place)
        results[(tp, pp)] = {"logprobs": _gather_to_rank0(outputs["logprobs"]),
                             "base_logprobs": _gather_to_rank0(base["logprobs"]),
                             "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                             "grads": grads, "trained": trained,
                             "adapter_elements": sum(p.numel() for p in
                                                     adapter_tensors(module).values()),
                             "served": _merged_weights(module, model, parallel, "lm",
                                                       served_parameters)}
    if dist.get_rank() == 0:
        torch.save(results, out_path)


def lora_rl_run(out_path: str, overrides: list[str], steps: int) -> None:
    """An RL run with adapters: its evaluation before the first step, `steps` steps (or what is
    left of them after a resume), an HF export, and the actor's log-probs of a fixed batch."""
    from mcore_rl.config import load_config
    from mcore_rl.rl import Trainer
    from rl_worker import TOY_CONFIG

    trainer = Trainer(load_config(TOY_CONFIG, overrides))
    first_step = trainer.step
    before = trainer.evaluate() if first_step == 0 else None
    history = [trainer.train_step() for _ in range(first_step, steps)]
    hf_dir = trainer.export_hf()
    input_ids = torch.randint(0, 16, (16, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    logprobs = trainer.roles.actor.logprobs(batch)["logprobs"]
    if dist.get_rank() == 0:
        torch.save({"before": before, "history": history, "hf_dir": hf_dir,
                    "input_ids": input_ids, "logprobs": logprobs,
                    "reference_is_actor": trainer.roles.reference.module
                    is trainer.roles.actor.module}, out_path)
    trainer.close()
