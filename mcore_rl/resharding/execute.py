"""Run a ReshardPlan: bucketed point-to-point messages, results streamed as they complete.

Why point-to-point
------------------
The plan says exactly which rows each rank lacks and who sends them, so the cheapest execution
is one message per (sender, receiver) pair per bucket: the sender packs its runs for that
receiver into one flat buffer, the receiver unpacks them into its rollout shards. No rank ever
builds a full tensor it does not want (peers all-gather then slice). The same code runs on gloo
(CPU) and NCCL (GPU): buffers live on the transport's device (runtime/transport.py).

Memory and overlap
------------------
Buckets are cut from the global plan so that on every rank the bytes sent plus received in one
bucket are at most half of ``bucket_bytes`` (a large parameter is spread over several buckets
in row chunks); the next bucket's messages are posted before the current bucket's shards are
handed out, so communication overlaps the engine's loading and at most ``bucket_bytes`` of
communication buffers exist at once. Within a bucket, shards are filled parameter by parameter
and each is handed out (the consumer owns it) as soon as its last rows are in, before the next
one is allocated. Peak extra memory is therefore ``bucket_bytes`` plus one rollout shard, if
the consumer lets go of each shard before it asks for the next (the vLLM engine does).

Only what changed
-----------------
Every sync's messages carry the same elements (the plan fixes them), so with ``delta`` each
message goes as its change since the last sync, against copies both ends keep (messages.py);
the shards handed out are the same, bit for bit.

Failure
-------
Before any byte moves, every rank checks its local tensors against the plan (names, shapes,
dtypes) and the ranks exchange their findings, so a bad input raises the same error on every
rank instead of leaving the others blocked in a receive.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from ..runtime.model_rank import ModelRank
from ..runtime.transport import Transport, WorldTransport
from .layouts import TrainingLayout, layout_order
from .messages import DeltaMessages, DeltaOptions, Segment, WholeMessages
from .plan import BucketEntry, ParamPlan, PlanError, ReshardPlan, Transfer

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 1024 ** 2
"""Communication buffer budget per rank (two half-size buckets in flight)."""


@dataclass
class _Bucket:
    """This rank's share of one bucket of the plan."""

    index: int
    placements: list[tuple[ParamPlan, list[tuple[int, int, Transfer]]]]
    """Every parameter the bucket touches, in canonical order, with the runs this rank
    receives of it: (sender, element offset in that sender's buffer, run)."""
    finished: set[str]
    """Parameters whose last runs are in this bucket: their shards are complete after it."""
    sends: dict[int, list[tuple[ParamPlan, Transfer]]]
    """Receiver rank -> runs this rank sends it, in packing order."""
    receives: dict[int, list[tuple[ParamPlan, Transfer]]]
    """Sender rank -> runs this rank receives from it, in packing order."""
    send_segments: dict[int, list[Segment]]
    """Receiver rank -> the message's runs as the messages see them (name, elements)."""
    receive_segments: dict[int, list[Segment]]
    """Sender rank -> the same for the message received."""


def _run_shape(param: ParamPlan, length: int) -> tuple:
    shape = list(param.full_shape)
    shape[param.dim] = length
    return tuple(shape)


def _run_elements(param: ParamPlan, transfer: Transfer) -> int:
    return transfer.length * param.row_elements


class DeltaMismatch(RuntimeError):
    """A rollout rank's copy rebuilt from deltas differs from what the trainer holds."""


class Resharder:
    """Delivers this rank's rollout shards from its training shards, following ``plan``."""

    def __init__(self, plan: ReshardPlan, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 transport: Transport | None = None, delta: DeltaOptions | None = None):
        """transport: the default world (colocated placement) unless given, e.g. the bridge
        between trainer and rollout ranks of split placement. delta: send each message as its
        change since the last sync (messages.py), else whole."""
        if bucket_bytes < 2 * plan.element_size:
            raise ValueError(f"bucket_bytes={bucket_bytes} is too small")
        self.plan = plan
        self.bucket_bytes = bucket_bytes
        """Communication buffers per rank (two half-size buckets in flight)."""
        self.transport = transport or WorldTransport()
        self.rank = self.transport.rank
        if self.transport.size != plan.job_world_size:
            raise PlanError(f"the plan covers {plan.job_world_size} ranks but the transport "
                            f"connects {self.transport.size}")
        self.held = plan.training.held(self.rank)
        self.wanted = plan.rollout.wanted(self.rank)
        self._full_shapes = {param.source: param.full_shape for param in plan.params}
        self._local_copies = {param.source: [t for t in param.local_copies if t.dst == self.rank]
                              for param in plan.params}
        buckets = plan.buckets(bucket_bytes // 2)
        last_bucket = {param.source: index for index, entries in enumerate(buckets)
                       for param, _ in entries}
        self._buckets = [self._my_share(index, entries, last_bucket)
                         for index, entries in enumerate(buckets)]
        self.messages = (WholeMessages(self.transport, plan.dtype) if delta is None
                         else DeltaMessages(self.transport, plan.dtype, delta))
        self.resent_whole = 0
        """Syncs resent whole after a delta checksum mismatch."""

    def _my_share(self, index: int, entries: list[BucketEntry],
                  last_bucket: Mapping[str, int]) -> _Bucket:
        sends: dict[int, list] = {}
        receives: dict[int, list] = {}
        placements, offsets = [], {}
        for param, runs in entries:
            mine = []
            for run in runs:
                if run.src == self.rank:
                    sends.setdefault(run.dst, []).append((param, run))
                if run.dst == self.rank:
                    receives.setdefault(run.src, []).append((param, run))
                    mine.append((run.src, offsets.get(run.src, 0), run))
                    offsets[run.src] = offsets.get(run.src, 0) + _run_elements(param, run)
            placements.append((param, mine))
        finished = {param.source for param, _ in entries if last_bucket[param.source] == index}
        return _Bucket(index, placements, finished, sends, receives,
                       {dst: [self._segment(p, run) for p, run in runs]
                        for dst, runs in sorted(sends.items())},
                       {src: [self._segment(p, run) for p, run in runs]
                        for src, runs in sorted(receives.items())})

    # ----------------------------------------------------------------------------------------

    def sync(self, local_tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (engine name, rollout shard) for every parameter this rank's engine part needs,
        in canonical order. ``local_tensors`` maps this rank's training local names (local-spec
        names, as `models.weights.local_parameters` gives) to its shards. Every rank must iterate
        the whole generator: the messages are collective. With verified delta messages, a
        checksum mismatch anywhere is logged as an error naming the tensor, and every shard is
        then sent whole and yielded again."""
        by_source = self._check_inputs(local_tensors)
        self.messages.start()
        yield from self._deliver(by_source)
        if not self.messages.verifies:
            return
        try:
            self.transport.agree(self.messages.mismatches, DeltaMismatch,
                                 "delta sync checksum mismatch, resending every shard whole: ")
        except DeltaMismatch as error:
            logger.error("%s", error)
            self.resent_whole += 1
            self.messages.resend_whole()
            yield from self._deliver(by_source)
            self.transport.agree(self.messages.mismatches, PlanError,
                                 "a whole resend after a delta mismatch mismatched too: ")

    @property
    def received_bytes(self) -> int:
        """Bytes this rank received in the last sync (for metrics and benchmarks)."""
        return self.messages.received_bytes

    def _deliver(self, by_source: Mapping[str, torch.Tensor]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every bucket's messages, the next posted before the current is unpacked."""
        if not self._buckets:
            return
        partial: dict[str, torch.Tensor] = {}
        pending = self._post(self._buckets[0], by_source)
        for position, bucket in enumerate(self._buckets):
            received = self.messages.wait(pending)
            if position + 1 < len(self._buckets):
                pending = self._post(self._buckets[position + 1], by_source)
            yield from self._unpack(bucket, by_source, received, partial)

    def _check_inputs(self, local_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical source -> local tensor, after every rank agreed that all inputs are valid."""
        errors, by_source = self._input_errors(local_tensors)
        self.transport.agree(errors, PlanError, "resharding refused, nothing was sent: ")
        return by_source

    def _input_errors(self, local_tensors: Mapping[str, torch.Tensor]) -> tuple[list[str], dict]:
        errors, by_source = [], {}
        known = {spec.name: spec for spec in self.held.values()}
        for name in sorted(set(local_tensors) - set(known)):
            errors.append(f"local tensor {name!r} is not in the plan's parameter metadata")
        for source, spec in self.held.items():
            tensor = local_tensors.get(spec.name)
            if tensor is None:
                errors.append(f"parameter {spec.name!r} ({source}) is missing from the local "
                              "tensors")
                continue
            expected = spec.shape(self._full_shapes[source])
            if tuple(tensor.shape) != expected:
                errors.append(f"tensor {spec.name!r} has shape {tuple(tensor.shape)}, the plan "
                              f"expects {expected}")
            elif tensor.dtype != self.plan.dtype:
                errors.append(f"tensor {spec.name!r} has dtype {tensor.dtype}, the plan expects "
                              f"{self.plan.dtype}")
            by_source[source] = tensor.detach()
        return errors, by_source

    # ----------------------------------------------------------------------------------------

    def _post(self, bucket: _Bucket, by_source: Mapping[str, torch.Tensor]) -> tuple:
        """Pack this rank's sends of ``bucket`` and start the bucket's exchange."""
        sends = {}
        for dst, runs in sorted(bucket.sends.items()):
            packed = torch.empty(sum(_run_elements(p, t) for p, t in runs), dtype=self.plan.dtype,
                                 device=self.transport.device)
            offset = 0
            for param, transfer in runs:
                count = _run_elements(param, transfer)
                source = by_source[param.source].narrow(param.dim, transfer.src_offset,
                                                        transfer.length)
                packed[offset:offset + count].view(source.shape).copy_(source)
                offset += count
            sends[dst] = (packed, bucket.send_segments[dst])
        return self.messages.post(bucket.index, bucket.receive_segments, sends)

    def _segment(self, param: ParamPlan, run: Transfer) -> Segment:
        """A run inside a message: its name in a checksum error (the engine's on the receiving
        side) and its element count."""
        spec = self.wanted.get(param.source)
        name = param.source if spec is None else spec.name
        rows = f"{run.dst_offset}:{run.dst_offset + run.length}"
        return f"{name} rows {rows} of dim {param.dim}", _run_elements(param, run)

    def _unpack(self, bucket: _Bucket, by_source: Mapping[str, torch.Tensor],
                received: Mapping[int, torch.Tensor], partial: dict[str, torch.Tensor]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Write the bucket's rows into this rank's rollout shards (``partial``, by source),
        parameter by parameter, handing each shard out as soon as it is complete and before
        the next one is started: at most one shard under construction besides the bucket
        (a shard begins with the rows this rank already has)."""
        for param, runs in bucket.placements:
            if param.source not in self.wanted:
                continue
            if param.source not in partial:
                partial[param.source] = self._start_shard(param, by_source)
            for src, offset, run in runs:
                count = _run_elements(param, run)
                rows = received[src][offset:offset + count].view(_run_shape(param, run.length))
                partial[param.source].narrow(param.dim, run.dst_offset, run.length).copy_(rows)
            if param.source in bucket.finished:
                yield self.wanted[param.source].name, partial.pop(param.source)

    def _start_shard(self, param: ParamPlan, by_source: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """A new rollout shard of ``param`` holding the rows this rank already has (padding rows
        zero)."""
        spec = self.wanted[param.source]
        shape = spec.shape(param.full_shape)
        out = (torch.zeros if spec.padding else torch.empty)(
            shape, dtype=self.plan.dtype, device=self.transport.device)
        for run in self._local_copies[param.source]:
            out.narrow(param.dim, run.dst_offset, run.length).copy_(
                by_source[param.source].narrow(param.dim, run.src_offset, run.length))
        return out


def megatron_training_layout(model, here: ModelRank) -> TrainingLayout:
    """The TrainingLayout of the trained models' layout `here` lives in, after checking that
    this rank's coordinates in it (expert-parallel rank included) are `here`'s (the plan relies
    on the rank order)."""
    # CP ranks hold the same weights: to the resharder they are more replicas.
    source = here.layout
    layout = TrainingLayout(model, source.tp, source.pp, source.dp * source.cp,
                            layout_order(source.order), source.ep, source.expert_tp)
    mine = (here.tp_rank, here.pp_rank, here.replica_rank, here.ep_rank, here.etp_rank)
    assumed = layout.coordinates(here.rank) + layout.holding(here.rank)[2:]
    if assumed != mine:
        raise PlanError(f"rank {here.rank} has coordinates (tp, pp, dp, ep, etp) = {mine} but "
                        f"the resharding layout assumes {assumed} for rank order "
                        f"{source.order}")
    return layout
