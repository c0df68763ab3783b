"""What one rank of a layout-invariance world does (run by tests/test_layout_invariance.py).

Every layout loads the same reference weights, computes per-token outputs for the same batch,
takes one optimizer step, and rank 0 saves the outputs and the merged updated weights. A
Mixture-of-Experts model also replays routes before the step (`routing_checks`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.config import (BatchConfig, JobConfig, ModelConfig, OptimizerConfig,
                             ParallelConfig, RuntimeConfig)
from mcore_rl.models import build_gpt_model, load_full_state
from mcore_rl.models.weights import local_parameters
from mcore_rl.models.moe_routing import NO_ROUTE, RoutingPass
from mcore_rl.runtime.devices import collective_device
from mcore_rl.param_layout import sharding
from mcore_rl.runtime import initialize, shutdown
from mcore_rl.training import compute_outputs, make_trainable, shard_for_data_parallel, train_step

MICRO_BATCH = 2
ROWS = 8
SEQ_LENGTH = 22
"""Not a multiple of 2 x CP x TP = 8: the TP2 x CP2 world pads its micro-batches' columns."""


def reference_full_state(model: ModelConfig, head: str, seed: int = 0) -> dict:
    """Random canonical weights: norms near 1, matrices with std 0.1 (large enough that
    attention and the vocabulary distribution are far from uniform)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in sharding.canonical_param_shapes(model, head).items():
        noise = torch.randn(shape, generator=generator)
        state[name] = 1 + 0.1 * noise if "norm" in name else 0.1 * noise
    return state


def reference_batch(model: ModelConfig, seq_length: int = SEQ_LENGTH, seed: int = 1) -> dict:
    """ROWS right-padded sequences of different lengths (one full length)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.vocab_size, (ROWS, seq_length), generator=generator)
    lengths = torch.randint(3, seq_length + 1, (ROWS,), generator=generator)
    lengths[0] = seq_length
    mask = (torch.arange(seq_length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    # Targets for the scalar head, a fixed function of the batch.
    targets = torch.randn(ROWS, seq_length, generator=generator)
    return {"input_ids": input_ids * mask, "attention_mask": mask, "value_targets": targets}


def policy_style_loss(outputs: dict, micro_batch: dict):
    """Sum of -logp and an entropy bonus over real tokens: exercises both outputs' gradients."""
    mask = micro_batch["attention_mask"].clone()
    mask[:, 0] = 0
    per_token = -outputs["logprobs"] - 0.1 * outputs["entropy"]
    return (per_token * mask).sum(), int(mask.sum()), {}


def value_loss(outputs: dict, micro_batch: dict):
    """Squared error of values against fixed targets over real tokens."""
    mask = micro_batch["attention_mask"].clone()
    mask[:, 0] = 0
    error = (outputs["values"] - micro_batch["value_targets"]) ** 2
    return (error * mask).sum(), int(mask.sum()), {}


def _gather_to_rank0(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate each DP rank's rows (DP ranks hold consecutive row blocks)."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


def routing_checks(chunks: list, local: dict, model: ModelConfig) -> dict:
    """The routes the routers take on `local`, then two replays: of those very routes, and of
    each route moved to the next expert. For each: the log-probs (all rows, rank 0), whether
    every router took exactly the given routes (all ranks), and the pass's MoE metrics."""
    natural = RoutingPass(model, replay=False, observe=True, keep_routes=True,
                          expect_routes=True)
    outputs = compute_outputs(chunks, local, MICRO_BATCH, "lm", model.vocab_size,
                              routing=natural)
    routes = natural.routes(*local["input_ids"].shape)
    moved = torch.where(routes == NO_ROUTE, routes, (routes + 1) % model.moe.num_experts)
    result = {"natural": {"logprobs": _gather_to_rank0(outputs["logprobs"]),
                          "metrics": natural.metrics(collective_device())}}
    # Every other row without routes (as an episode ended by a failed reset reaches r3): those
    # rows keep their routers' own choices, the others follow the moved routes.
    unrouted = (torch.arange(routes.shape[0]) % 2 == 0)[:, None, None, None]
    partly = torch.where(unrouted, NO_ROUTE, moved)
    result["unrouted_rows"] = _gather_to_rank0(unrouted.flatten())
    for name, given in (("replayed", routes), ("moved", moved), ("partly", partly)):
        replay = RoutingPass(model, replay=True, observe=True, keep_routes=True,
                             expect_routes=True)
        outputs = compute_outputs(chunks, dict(local, routed_experts=given), MICRO_BATCH, "lm",
                                  model.vocab_size, routing=replay)
        taken = replay.routes(*local["input_ids"].shape).sort(dim=-1).values
        mine = given != NO_ROUTE  # this stage's layers (and the routed rows)
        followed = torch.tensor([float(torch.equal(taken[mine],
                                                   given.sort(dim=-1).values[mine]))])
        dist.all_reduce(followed, op=dist.ReduceOp.MIN)
        result[name] = {"logprobs": _gather_to_rank0(outputs["logprobs"]),
                        "followed": bool(followed.item()),
                        "metrics": replay.metrics(collective_device())}
    return result


def _merged_weights(module, model: ModelConfig, parallel: ParallelConfig, head: str,
                    state_of=local_parameters):
    """The full updated weights, merged from every rank's shards (None off rank 0): each
    canonical tensor from its TP shards, an expert's from its expert-TP shards (every (pp, ep)
    rank holding it agrees). state_of: the stage's local tensors by canonical local name."""
    from mcore_rl.checkpoint.sharded_weights import split_of, stage_params_of
    from mcore_rl.models.weights import model_rank_of

    place = model_rank_of(module)
    names = stage_params_of(place, model, head)
    state = {names[local]: (split_of(place, names[local]), tensor.detach().cpu().clone())
             for local, tensor in state_of(module).items()}
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, state)
    if dist.get_rank() != 0:
        return None
    shards, sizes = {}, {}  # canonical name -> {split rank: shard}; replicas are identical
    for rank_state in everything:
        for name, ((size, split_rank), tensor) in rank_state.items():
            shards.setdefault(name, {})[split_rank], sizes[name] = tensor, size
    return {name: sharding.merge_from_tp(name, [shards[name][r] for r in range(sizes[name])],
                                         model, sizes[name])
            for name in sharding.canonical_param_shapes(model, head)}


def run_layout(model: ModelConfig, tp: int, pp: int, out_path: str,
               use_distributed_optimizer: bool = True, ep: int = 1,
               dispatcher: str = "alltoall", sequence_parallel: bool = False,
               etp: int | None = None, cp: int = 1) -> None:
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              context_parallel_size=cp,
                              expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                              moe_token_dispatcher=dispatcher,
                              sequence_parallel=sequence_parallel)
    # adam_eps well above gradient round-off keeps Adam's first step (~lr * sign(g)) continuous
    # in g, so layouts that differ by float summation order stay within the tolerance.
    optimizer = OptimizerConfig(lr=1e-2, adam_eps=1e-3, clip_grad=1.0,
                                use_distributed_optimizer=use_distributed_optimizer)
    config = JobConfig(model=model, parallel=parallel, optimizer=optimizer,
                       batch=BatchConfig(global_batch_size=ROWS, micro_batch_size=MICRO_BATCH,
                                         seq_length=SEQ_LENGTH),
                       runtime=RuntimeConfig(collective_timeout_minutes=3))
    place = initialize(config).training
    from megatron.core import parallel_state

    batch = reference_batch(model)
    local = shard_for_data_parallel(batch, parallel_state.get_data_parallel_rank(),
                                    parallel_state.get_data_parallel_world_size())
    result = {}
    for head, loss in (("lm", policy_style_loss), ("scalar", value_loss)):
        module = build_gpt_model(model, parallel, "fp32", head=head, place=place)
        load_full_state(module, reference_full_state(model, head), model, head)
        trainable = make_trainable(module, optimizer, "fp32")
        outputs = compute_outputs(trainable.chunks, local, MICRO_BATCH, head, model.vocab_size)
        result[head] = {name: _gather_to_rank0(value) for name, value in outputs.items()}
        if model.moe.enabled and head == "lm":
            result["routing"] = routing_checks(trainable.chunks, local, model)
        result[head]["metrics"] = train_step(trainable, local, MICRO_BATCH, loss, head,
                                             model.vocab_size)
        result[head]["weights"] = _merged_weights(module, model, parallel, head)
    result["expert_grid"] = _expert_grid()
    if dist.get_rank() == 0:
        torch.save(result, out_path)
    shutdown()


def _expert_grid() -> list[tuple[int, int, int]]:
    """Every rank's (TP rank, EP rank, expert-TP size) in Megatron's live parallel state."""
    from megatron.core import parallel_state as ps

    grid = [None] * dist.get_world_size()
    dist.all_gather_object(grid, (ps.get_tensor_model_parallel_rank(),
                                  ps.get_expert_model_parallel_rank(),
                                  ps.get_expert_tensor_parallel_world_size()))
    return grid
