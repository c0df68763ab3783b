"""One rank of the conversion parity world: load converted checkpoints at several layouts and
return the Megatron logits (gathered over TP, padding vocabulary dropped) to rank 0."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.checkpoint.weights_io import read_metadata
from mcore_rl.config import InitConfig, ParallelConfig
from mcore_rl.models import build_gpt_model
from mcore_rl.models.pretrained import load_initial_weights
from mcore_rl.models.weights import model_rank_of


def megatron_logits(module, ids: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Full logits [b, s, vocab] through Megatron's pipeline schedule (gathered over TP on the
    last stage), returned on every rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        return model(tokens, positions, attention_mask=None), gather_logits

    def gather_logits(output, non_loss_data=True):
        group = ps.get_tensor_model_parallel_group()
        parts = [torch.empty_like(output) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, output.contiguous(), group=group)
        return torch.cat(parts, dim=-1)[..., :vocab_size].float()

    with torch.no_grad():
        collected = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([ids]), model=[module],
            num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
            forward_only=True, collect_non_loss_data=True)
    logits = collected[0] if ps.is_pipeline_last_stage() else None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, logits)
    return next(item for item in gathered if item is not None)


def _set_layout(tp: int, pp: int, ep: int = 1, etp: int | None = None):
    """The trained models' groups at this layout over the world (those of an earlier layout
    torn down); returns this rank in them."""
    from megatron.core import tensor_parallel

    from mcore_rl.runtime.layout import ParallelLayout
    from mcore_rl.runtime.training_groups import (destroy_training_groups,
                                                  initialize_training_groups)

    destroy_training_groups()
    layout = ParallelLayout(tp, pp, dist.get_world_size() // (tp * pp), ep=ep, etp=etp)
    place = initialize_training_groups(layout, timeout_minutes=3)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    return place


def _check_critic_trunk(lm_module, init: InitConfig, model, parallel) -> None:
    """A scalar-head model started from the same LM weights holds the same trunk, and a
    zero-initialised head."""
    from mcore_rl.models import local_state
    from mcore_rl.param_layout import sharding

    critic = build_gpt_model(model, parallel, "fp32", head="scalar",
                             place=model_rank_of(lm_module))
    assert load_initial_weights(critic, init, model, head="scalar")
    lm_state, critic_state = local_state(lm_module), local_state(critic)
    for name, tensor in critic_state.items():
        if name == sharding.SCALAR_HEAD:
            assert not tensor.any()
        else:
            assert torch.equal(tensor, lm_state[name]), name


def _model_of(init: InitConfig):
    if init.hf_path:
        from mcore_rl.conversion.hf_to_mcore import model_config_of_hf
        return model_config_of_hf(init.hf_path)
    return read_metadata(init.checkpoint)["model"]


def run_parity(jobs: list, layouts: list, ids: torch.Tensor, out_path: str) -> None:
    """jobs: [(case, InitConfig)]; saves {(case, source, tp, pp): logits} on rank 0. Layouts
    are the outer loop: re-creating Megatron's process groups is the slow part."""
    from mcore_rl.runtime import start_process_group

    start_process_group(timeout_minutes=3)
    results = {}
    for tp, pp in layouts:
        place = _set_layout(tp, pp)
        parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        for case, init in jobs:
            model = _model_of(init)
            module = build_gpt_model(model, parallel, "fp32", place=place).eval()
            assert load_initial_weights(module, init, model)
            source = "hf" if init.hf_path else "mcore"
            results[(case, source, tp, pp)] = megatron_logits(module, ids, model.vocab_size)
            _check_critic_trunk(module, init, model, parallel)
    if dist.get_rank() == 0:
        torch.save(results, out_path)


def run_expert_parity(checkpoints: dict, layouts: list, ids: torch.Tensor, saved_root: str,
                      out_path: str) -> None:
    """checkpoints: {case: converted checkpoint}; layouts: [(tp, pp, ep, etp)]. At the first
    layout each case is loaded and saved again (weights checkpoint at that EP and ETP); every
    layout then loads both and records their logits as (case, source, tp, pp, ep, etp) on rank
    0, source "converted" or "resaved"."""
    from mcore_rl.checkpoint.weights_io import save_weights
    from mcore_rl.models import local_state
    from mcore_rl.runtime import start_process_group

    start_process_group(timeout_minutes=3)
    results = {}
    for index, (tp, pp, ep, etp) in enumerate(layouts):
        place = _set_layout(tp, pp, ep, etp)
        parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        for case, checkpoint in checkpoints.items():
            model = read_metadata(checkpoint)["model"]
            resaved = f"{saved_root}/{case}"
            for source, path in (("converted", checkpoint), ("resaved", resaved)):
                module = build_gpt_model(model, parallel, "fp32", place=place).eval()
                assert load_initial_weights(module, InitConfig(checkpoint=path), model)
                results[(case, source, tp, pp, ep, etp)] = megatron_logits(module, ids,
                                                                      model.vocab_size)
                if index == 0 and source == "converted":
                    save_weights(resaved, local_state(module), model, place)
    if dist.get_rank() == 0:
        torch.save(results, out_path)
