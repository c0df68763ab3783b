"""What one rank of a resharding world does (run by tests/test_resharding_world.py).

Every rank cuts its training shards from the same reference weights, runs the real gloo
resharder, and compares each delivered tensor bitwise with the reference layouts. Results are
written by rank 0 as a dict of {check name: list of per-rank findings}; an exception on any rank
fails the world.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from mcore_rl.config import ModelConfig
from mcore_rl.param_layout import sharding
from mcore_rl.resharding import (PlanError, Resharder, TrainingLayout, build_plan,
                                 make_rollout_layout)
from mcore_rl.resharding.delivery import hf_named
from resharding_reference import LLAMA, expected_shards, reference_full_state


def _gather(value) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _local_shards(full, layout: TrainingLayout) -> dict[str, torch.Tensor]:
    tp_rank, pp_rank, _ = layout.coordinates(dist.get_rank())
    return sharding.shard_full_state(full, layout.model, layout.tp, layout.pp, tp_rank, pp_rank)


def _mismatches(delivered: dict, expected: dict) -> list[str]:
    """Names that are missing, extra or not bitwise equal."""
    wrong = sorted(set(delivered) ^ set(expected))
    wrong += [name for name in delivered if name in expected
              and not torch.equal(delivered[name], expected[name])]
    return wrong


def check_pair(model: ModelConfig, training_dims, engine: str, rollout_tp: int,
               bucket_bytes: int) -> dict:
    """Deliver one layout pair; returns what this rank found."""
    full = reference_full_state(model)
    layout = TrainingLayout(model, *training_dims)
    rollout = make_rollout_layout(layout, engine, rollout_tp)
    plan = build_plan(layout, rollout, torch.float32)
    resharder = Resharder(plan, bucket_bytes=bucket_bytes)
    delivered = dict(resharder.sync(_local_shards(full, layout)))
    rank = dist.get_rank()
    if engine == "full":
        expected_hf = {}
        for name, tensor in full.items():
            expected_hf.update(LLAMA.from_canonical(name, tensor, model))
        hf = dict(hf_named(delivered.items(), LLAMA, model))
        wrong = _mismatches(hf, expected_hf)
    else:
        wrong = _mismatches(delivered, expected_shards(full, model, engine, rollout_tp,
                                                       rollout.tp_rank_of[rank]))
    return {"wrong": wrong, "digest": plan.digest(), "buckets": len(resharder._buckets),
            "count": len(delivered)}


def check_bad_input(model: ModelConfig) -> str:
    """Rank 1 lacks one tensor: every rank must raise before anything is sent."""
    layout = TrainingLayout(model, 2, 2, 1)
    plan = build_plan(layout, make_rollout_layout(layout, "vllm", 4), torch.float32)
    local = _local_shards(reference_full_state(model), layout)
    if dist.get_rank() == 1:
        local.pop("decoder.layers.0.mlp.linear_fc2.weight")
    try:
        dict(Resharder(plan).sync(local))
    except PlanError as error:
        return str(error)
    return "no error"


def run_checks(model: ModelConfig, cases: list, out_path: str, with_bad_input: bool) -> None:
    dist.init_process_group("gloo")
    results = {}
    for training_dims, engine, rollout_tp, bucket_bytes in cases:
        key = f"{training_dims}->{engine}{rollout_tp}"
        results[key] = _gather(check_pair(model, training_dims, engine, rollout_tp,
                                          bucket_bytes))
    if with_bad_input:
        results["bad_input"] = _gather(check_bad_input(model))
        tied = dataclasses.replace(model, tie_embeddings=True)
        results["tied after bad input"] = _gather(check_pair(tied, (2, 2, 1), "vllm", 4, 1 << 14))
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# With a real Megatron model and optimizer
# --------------------------------------------------------------------------------------------

def run_megatron_sync(model: ModelConfig, out_path: str) -> None:
    """TP2 x PP2 Megatron model: sync to vLLM TP4, take an optimizer step, sync again."""
    from layout_worker import ROWS, policy_style_loss, reference_batch
    from mcore_rl.config import (BatchConfig, JobConfig, OptimizerConfig, ParallelConfig,
                                 RuntimeConfig)
    from mcore_rl.models import build_gpt_model, load_full_state, local_state
    from mcore_rl.models.weights import local_parameters
    from mcore_rl.resharding.execute import megatron_training_layout
    from mcore_rl.runtime import initialize, shutdown
    from mcore_rl.training import make_trainable, shard_for_data_parallel, train_step

    parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    optimizer = OptimizerConfig(lr=1e-2, clip_grad=1.0)
    config = JobConfig(model=model, parallel=parallel, optimizer=optimizer,
                       batch=BatchConfig(global_batch_size=ROWS, micro_batch_size=2,
                                         seq_length=24),
                       runtime=RuntimeConfig(collective_timeout_minutes=3))
    place = initialize(config).training
    from megatron.core import parallel_state as ps

    module = build_gpt_model(model, parallel, "fp32", place=place)
    load_full_state(module, reference_full_state(model), model)
    trainable = make_trainable(module, optimizer, "fp32")
    layout = megatron_training_layout(model, place)
    plan = build_plan(layout, make_rollout_layout(layout, "vllm", 4), torch.float32)
    resharder = Resharder(plan, bucket_bytes=1 << 16)

    def sync_and_compare() -> list[str]:
        delivered = dict(resharder.sync(local_parameters(module)))
        key = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
        merged = sharding.merge_shards(dict(_gather((key, local_state(module)))), model, 2, 2)
        return _mismatches(delivered, expected_shards(merged, model, "vllm", 4,
                                                      plan.rollout.tp_rank_of[dist.get_rank()]))

    before = sync_and_compare()
    first = {name: tensor.clone() for name, tensor in resharder.sync(local_parameters(module))}
    batch = shard_for_data_parallel(reference_batch(model), 0, 1)
    train_step(trainable, batch, 2, policy_style_loss, "lm", model.vocab_size)
    after = sync_and_compare()
    second = dict(resharder.sync(local_parameters(module)))
    changed = [name for name in first if not torch.equal(first[name], second[name])]
    result = _gather({"before": before, "after": after, "changed": len(changed),
                      "total": len(first)})
    if dist.get_rank() == 0:
        torch.save(result, out_path)
    shutdown()


def run_split_checks(model: ModelConfig, rollout_ranks: int, cases: list, out: str) -> None:
    """Split placement: the last `rollout_ranks` ranks form their own world and receive their
    rollout shards from the trainer ranks over the bridge. Each rank saves its findings to
    `out.<job rank>` (the two sides share no default world to gather over)."""
    import datetime

    from mcore_rl.resharding.plan import lower_bound_received
    from mcore_rl.runtime import read_launch_env
    from mcore_rl.runtime.worlds import start_split_worlds

    job = read_launch_env()
    world = start_split_worlds(job, rollout_ranks, "gloo", datetime.timedelta(minutes=2))
    side_sum = torch.tensor([float(job.rank)])
    dist.all_reduce(side_sum)  # over this side's default world only
    found = {"side": world.side, "side_rank": dist.get_rank(),
             "side_size": dist.get_world_size(), "side_sum": float(side_sum)}
    full = reference_full_state(model)
    for training_dims, engine, rollout_tp, bucket_bytes in cases:
        layout = TrainingLayout(model, *training_dims)
        rollout = make_rollout_layout(layout, engine, rollout_tp, rollout_ranks=rollout_ranks)
        plan = build_plan(layout, rollout, torch.float32)
        local = {}
        if world.side == "trainer":
            tp_rank, pp_rank, _ = layout.coordinates(job.rank)
            local = sharding.shard_full_state(full, model, layout.tp, layout.pp, tp_rank,
                                              pp_rank)
        resharder = Resharder(plan, bucket_bytes, transport=world.bridge)
        delivered = dict(resharder.sync(local))
        expected = {} if world.side == "trainer" else expected_shards(
            full, model, engine, rollout_tp, rollout.tp_rank_of[job.rank - layout.world_size])
        found[f"{training_dims}->{engine}{rollout_tp}"] = {
            "wrong": _mismatches(delivered, expected), "count": len(delivered),
            "received": resharder.received_bytes,
            "lower_bound": int(lower_bound_received(layout, rollout, 4)[job.rank]),
            "sent": int(plan.traffic().sent[job.rank])}
    training_dims, engine, rollout_tp, _ = cases[0]
    layout = TrainingLayout(model, *training_dims)
    plan = build_plan(layout, make_rollout_layout(layout, engine, rollout_tp,
                                                  rollout_ranks=rollout_ranks), torch.float32)
    local = {}
    if job.rank == 1:
        local = {"decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(3, 3)}
    elif world.side == "trainer":
        tp_rank, pp_rank, _ = layout.coordinates(job.rank)
        local = sharding.shard_full_state(full, model, layout.tp, layout.pp, tp_rank, pp_rank)
    try:
        list(Resharder(plan, transport=world.bridge).sync(local))
        found["bad_input"] = None
    except PlanError as error:
        found["bad_input"] = str(error)
    torch.save(found, f"{out}.{job.rank}")


# --------------------------------------------------------------------------------------------
# Delta syncs
# --------------------------------------------------------------------------------------------

def _optimizer_like_step(full: dict, step: int, dtype: torch.dtype) -> dict:
    """The weights after an update at an RL learning rate, in the engine's dtype: each element
    moves by about 1e-3 of its size, so most keep their bf16 value; one tensor is rewritten
    whole (a delta bigger than the shard goes whole) and two elements take -0.0 and NaN."""
    generator = torch.Generator().manual_seed(1000 + step)
    moved = {}
    for index, (name, tensor) in enumerate(sorted(full.items())):
        noise = torch.randn(tensor.shape, generator=generator)
        scale = 1.0 if index == step % len(full) else 1e-3
        moved[name] = tensor * (1 + scale * noise)
    first = sorted(moved)[0]
    moved[first].view(-1)[:2] = torch.tensor([-0.0, float("nan")])
    return {name: tensor.to(dtype).to(torch.float32) for name, tensor in moved.items()}


def run_delta_syncs(model: ModelConfig, dtype: torch.dtype, syncs: int) -> dict:
    """TP2 x PP2 -> vLLM TP2 over 4 ranks, `syncs` delta syncs (anchor every 4, verified)
    after optimizer-like steps, each compared bitwise with the reference layout; then a bit
    flipped in one rank's held copy and the same weights synced again (caught and resent
    whole, the error naming the tensor) and a resharder made afresh, as after a restart (its
    first sync whole)."""
    import logging

    from mcore_rl.resharding.messages import DeltaOptions
    from mcore_rl.resharding.plan import lower_bound_received

    layout = TrainingLayout(model, 2, 2, 1)
    rollout = make_rollout_layout(layout, "vllm", 2)
    plan = build_plan(layout, rollout, dtype)
    rank = dist.get_rank()
    options = DeltaOptions(anchor_every=4, verify=True)
    resharder = Resharder(plan, bucket_bytes=1 << 14, delta=options)
    lower_bound = int(lower_bound_received(layout, rollout, plan.element_size)[rank])
    errors: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: errors.append(record.getMessage())
    logging.getLogger("mcore_rl.resharding.execute").addHandler(handler)

    def sync(resharder: Resharder, full: dict) -> dict:
        local = {name: tensor.to(dtype) for name, tensor in _local_shards(full, layout).items()}
        delivered = dict(resharder.sync(local))
        expected = {name: tensor.to(dtype) for name, tensor in expected_shards(
            full, model, "vllm", 2, rollout.tp_rank_of[rank]).items()}
        wrong = sorted(set(delivered) ^ set(expected)) + [
            name for name in expected if name in delivered and not torch.equal(
                delivered[name].view(torch.uint8), expected[name].view(torch.uint8))]
        return {"wrong": wrong, "received": resharder.received_bytes}

    full = {name: t.to(dtype).to(torch.float32) for name, t in reference_full_state(model).items()}
    found = {"lower_bound": lower_bound, "syncs": []}
    for step in range(syncs):
        if step:
            full = _optimizer_like_step(full, step, dtype)
        found["syncs"].append(sync(resharder, full))
    held = resharder.messages._held
    found["held"] = len(held)
    if rank == 1:  # a bit flips in this rank's copy of one message, the weights stay
        key = sorted(held)[len(held) // 2]
        held[key].view(-1)[0:1].view(torch.uint8)[0] ^= 1
    found["flipped"] = sync(resharder, full)
    found["resent_whole"] = resharder.resent_whole
    found["errors"] = errors
    logging.getLogger("mcore_rl.resharding.execute").removeHandler(handler)
    found["restarted"] = sync(Resharder(plan, bucket_bytes=1 << 14, delta=options), full)
    return found


def run_delta_checks(model: ModelConfig, syncs: int) -> dict:
    dist.init_process_group("gloo")
    found = {str(dtype): run_delta_syncs(model, dtype, syncs)
             for dtype in (torch.bfloat16, torch.float32)}
    dist.destroy_process_group()
    return found
