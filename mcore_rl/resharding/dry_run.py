"""Size a weight sync before launch: bytes, memory and time per rank, with no processes started.

For a model config and both layouts, three strategies are compared:

* ``ours``: the plan mcore_rl executes (plan.py), in the training rank order `mcore-rl train`
  chooses (rank_order.py; Megatron's default order's figure is shown beside it);
* ``full-gather``: what verl, slime and NeMo-RL's colocated path do (full_gather.py): TP
  all-gather on the owning stage (an expert's tensor: plus an all-gather over the expert-parallel
  ranks), then a broadcast through the pipeline; every rank gets every full tensor and slices it;
* ``lower bound``: each rank receives exactly the bytes of its rollout shard it does not hold.

With a delta share (``rollout.delta_sync``: the share of the lower bound a delta sync carries,
measured by bench/delta_sync.py) the table adds what a delta sync would move and take, and
the copies it keeps per rank (what the rank sends plus receives in a whole sync).

Time is a link model, not a measurement: a rank's bytes to and from ranks on its node move at
``intra_node_gbps``, the rest at ``inter_node_gbps``; a rank's time is the larger of its send and
receive times and the sync takes as long as the slowest rank. Latency and congestion are
ignored, so treat times as lower estimates that rank strategies, not as predictions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mcore_rl.param_layout import sharding

from .full_gather import full_gather_peak_bytes, full_gather_transfers
from .layouts import DEFAULT_ORDER, RolloutLayout, TrainingLayout
from .grouping import make_rollout_layout
from .plan import Traffic, bucket_load, build_plan, lower_bound_received, traffic_of
from .rank_order import choose_training_order

GB = 1e9


@dataclass(frozen=True)
class Links:
    """Per-GPU link bandwidths and node size."""

    gpus_per_node: int = 8
    """GPUs per node: ranks r and s share a node iff r // gpus_per_node == s // gpus_per_node."""

    intra_node_gbps: float = 400.0
    """GB/s a GPU sends (and receives) to GPUs on its node (NVLink-class)."""

    inter_node_gbps: float = 50.0
    """GB/s a GPU sends (and receives) to other nodes (one 400 Gb/s NIC per GPU)."""


@dataclass(frozen=True)
class Estimate:
    """One strategy's figures (bytes are per rank)."""

    strategy: str
    max_received: float
    mean_received: float
    peak_extra: float | None
    seconds: float | None
    max_sent_and_received: float | None = None
    """The most bytes one rank sends plus receives: what a delta sync's copies hold."""


def _seconds(traffic: Traffic, links: Links) -> float:
    def one_way(total: np.ndarray, off_node: np.ndarray) -> np.ndarray:
        return ((total - off_node) / (links.intra_node_gbps * GB)
                + off_node / (links.inter_node_gbps * GB))

    return float(np.maximum(one_way(traffic.received, traffic.received_off_node),
                            one_way(traffic.sent, traffic.sent_off_node)).max())


def _largest_rollout_shard(rollout: RolloutLayout, element_size: int) -> int:
    shapes = sharding.canonical_param_shapes(rollout.model)
    largest = 0
    for tp_rank in range(rollout.tp):
        rank = rollout.tp_rank_of.index(tp_rank)
        for source, spec in rollout.wanted(rank).items():
            largest = max(largest, math.prod(spec.shape(shapes[source])))
    return largest * element_size


def rollout_weight_bytes(rollout: RolloutLayout, element_size: int) -> int:
    """The most weight bytes any rank's engine holds (ranks with equal shard keys hold the
    same shards)."""
    shapes = sharding.canonical_param_shapes(rollout.model)
    per_key = {}
    for rank in rollout.ranks:
        key = rollout.shard_key(rank)
        if key not in per_key:
            per_key[key] = sum(math.prod(spec.shape(shapes[source]))
                               for source, spec in rollout.wanted(rank).items())
    return max(per_key.values()) * element_size


def estimate(training: TrainingLayout, engine: str, rollout_tp: int,
             dtype: torch.dtype, links: Links = Links(), bucket_bytes: int = 512 * 1024 ** 2,
             expert_parallel: bool = False) -> tuple[RolloutLayout, list[Estimate]]:
    """The rollout layout chosen and the three strategies' estimates."""
    rollout = make_rollout_layout(training, engine, rollout_tp, links.gpus_per_node,
                                  expert_parallel=expert_parallel)
    plan = build_plan(training, rollout, dtype, links.gpus_per_node)
    element = plan.element_size
    world = training.world_size
    ours = traffic_of(plan.params, world, element, links.gpus_per_node)
    baseline = traffic_of(full_gather_transfers(training), world, element, links.gpus_per_node)
    lower = lower_bound_received(training, rollout, element)
    largest_output = _largest_rollout_shard(rollout, element)
    buffers = 2 * max(int(bucket_load(bucket, world, element).max())
                      for bucket in plan.buckets(bucket_bytes // 2))
    return rollout, [
        Estimate("ours", ours.received.max(), ours.received.mean(), buffers + largest_output,
                 _seconds(ours, links), float((ours.sent + ours.received).max())),
        Estimate("full-gather", baseline.received.max(), baseline.received.mean(),
                 full_gather_peak_bytes(training, element) + largest_output,
                 _seconds(baseline, links)),
        Estimate("lower bound", lower.max(), lower.mean(), None, None),
    ]


@dataclass(frozen=True)
class Production:
    """What `mcore-rl train` does for one world: its rank order, layouts and estimates."""

    training: TrainingLayout
    rollout: RolloutLayout
    estimates: list[Estimate]
    rollout_weight_bytes: int
    """The most weight bytes one rollout rank's engine holds (its shards, vocabulary padding
    included)."""
    default_order_received: float
    """The busiest rank's bytes with Megatron's default rank order instead."""


def production_estimate(model, tp: int, pp: int, dp: int, engine: str, rollout_tp: int,
                        dtype: torch.dtype, links: Links = Links(),
                        bucket_bytes: int = 512 * 1024 ** 2, ep: int = 1,
                        etp: int | None = None,
                        rollout_expert_parallel: bool = False) -> Production:
    """The estimates for the training rank order the trainer picks (for vLLM; other engines
    keep Megatron's default order and plan their own grouping). ep: expert-parallel size;
    etp: expert tensor-parallel size (None: TP); rollout_expert_parallel: vLLM's expert
    parallelism."""
    order = DEFAULT_ORDER
    if engine == "vllm":
        order = choose_training_order(model, tp, pp, dp, rollout_tp, links.gpus_per_node, ep,
                                      etp, rollout_expert_parallel)
    training = TrainingLayout(model, tp, pp, dp, order, ep, etp)
    rollout, estimates = estimate(training, engine, rollout_tp, dtype, links, bucket_bytes,
                                  rollout_expert_parallel)
    default_received = estimates[0].max_received
    if order != DEFAULT_ORDER:
        default_received = estimate(TrainingLayout(model, tp, pp, dp, DEFAULT_ORDER, ep, etp),
                                    engine, rollout_tp, dtype, links, bucket_bytes,
                                    rollout_expert_parallel)[1][0].max_received
    return Production(training, rollout, estimates,
                      rollout_weight_bytes(rollout, dtype.itemsize),
                      default_received)


def _gib(value: float) -> str:
    return f"{value / 1024 ** 3:.2f}"


def table_header(delta_share: float | None = None) -> list[str]:
    """The table's header lines (Markdown); the training layout column is TPxPPxDP, with xEP
    appended when experts are split over expert-parallel ranks (and xETP when the experts'
    tensor-parallel size is not TP's); the rollout column is TPxDP, with xEP when vLLM's expert
    parallelism serves each rank's experts whole. With `delta_share`, a last column for delta
    syncs."""
    delta = ("" if delta_share is None else
             f" delta sync at {delta_share:.1%}: max GiB / est. s / copies GiB |")
    return ["| GPUs | training TPxPPxDP[xEP] | rollout TPxDP[xEP] | max GiB received: ours / "
            "full-gather / lower bound | ours / full-gather | est. s: ours / full-gather | "
            "peak extra GiB: ours / full-gather | rank order | ours with Megatron's default "
            "order: max GiB | rollout weights GiB per GPU |" + delta,
            "|---:|---|---|---|---:|---|---|---|---:|---:|" + ("" if delta_share is None
                                                               else "---|")]


def _training_dims(training: TrainingLayout) -> str:
    """TPxPPxDP, plus xEP<n> when expert parallelism splits the experts and xETP<n> when the
    experts' tensor-parallel size is not TP (so dense and EP-1 rows read as before)."""
    dims = f"{training.tp}x{training.pp}x{training.dp}"
    dims += f"xEP{training.ep}" if training.ep > 1 else ""
    return dims + (f"xETP{training.etp}" if training.grid.expert_tp != training.tp else "")


def table_row(production: Production, delta_share: float | None = None) -> str:
    """One Markdown row of `table_header`'s table. A delta sync's bytes and time are the whole
    sync's scaled by the share (the link model; encoding is not modelled)."""
    training, rollout = production.training, production.rollout
    ours, full, lower = production.estimates
    rollout_dims = f"{rollout.tp}x{rollout.instances}" + (
        f"xEP{rollout.world_size}" if rollout.expert_parallel else "")
    return (f"| {training.world_size} | {_training_dims(training)} | "
            f"{rollout_dims} | {_gib(ours.max_received)} / "
            f"{_gib(full.max_received)} / {_gib(lower.max_received)} | "
            f"{ours.max_received / full.max_received:.2f} | "
            f"{ours.seconds:.2f} / {full.seconds:.2f} | "
            f"{_gib(ours.peak_extra)} / {_gib(full.peak_extra)} | {training.megatron_order} | "
            f"{_gib(production.default_order_received)} | "
            f"{_gib(production.rollout_weight_bytes)} |" + (
                "" if delta_share is None else
                f" {_gib(ours.max_received * delta_share)} / {ours.seconds * delta_share:.3f} / "
                f"{_gib(ours.max_sent_and_received)} |"))
