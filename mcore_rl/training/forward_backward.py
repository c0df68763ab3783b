"""Forward and forward-backward passes through Megatron's pipeline schedules.

`compute_outputs` runs forward-only and returns per-token outputs (log-probs and entropy for an
LM head, values for a scalar head) on every rank of the model-parallel group: the last pipeline
stage computes them and broadcasts them to the other stages, so SPMD code after it can treat
all ranks alike. `train_step` runs forward-backward and one optimizer step.

A batch may name the positions whose outputs its caller uses (`output_mask`, e.g. the response
tokens of an RL batch): the output layer then runs only over those (`_UsedOutputs`: from the
first such column on in a row-form micro-batch, exactly those positions in a packed one, whose
rows' prompts lie between the responses). Prompt positions of an RL batch need no logits; with
a vocabulary of 50-150k the LM head and its log-softmax are a fifth or more of a small model's
forward pass (TRL's `logits_to_keep` does the same). Callers read the used positions only
(the others hold 0 where the output layer skipped them, values where it did not).

Batches may live anywhere (the trainer keeps them in host memory): each micro-batch is moved to
the model's device as the schedule asks for it, so only one micro-batch at a time occupies the
GPU, and outputs come back on the device of the batch that was passed in.

Losses are global means by construction: a loss function returns a numerator and an
integer-valued denominator per micro-batch (tensors: nothing read on the host); Megatron
(`calculate_per_token_loss`) sums the denominators over micro-batches and data-parallel ranks
and divides the summed gradients by that total. A token-mean, a sequence-mean or any other
aggregation is exact whatever the layout.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from ..models.context_parallel import gather_per_token, split_for_rank
from ..models.logprobs import vocab_parallel_logprobs_and_entropy
from ..models.moe_routing import NO_ROUTE, RoutingPass
from ..models.weights import model_rank_of
from ..runtime.devices import collective_device, module_device, to_device
from ..runtime.log import print0
from ..runtime.model_rank import ModelRank
from .batches import (Batch, PackedRows, align_to_tokens, check_batch,
                      pad_columns_to_multiple, packed_micro_batches, split_micro_batches,
                      token_budget_micro_batches)
from .optimizer import TrainableModel

LossFn = Callable[[dict, Batch], tuple]
"""(outputs: per-token tensors [b, s], micro_batch) -> (numerator, denominator, metrics)."""


def _per_token_outputs(output: torch.Tensor, micro_batch: Batch, head: str,
                       vocab_size: int, temperature: float, tp_group, cp_group,
                       packing: PackedRows | None, used: "_UsedOutputs") -> dict:
    """Megatron's last-stage output [b, s', v_local or 1] for the `used` positions, or under
    context parallelism for this rank's two chunks, or for a packed micro-batch [1, t', ...]
    for the used packed positions -> token-aligned [b, s] tensors. Logits are divided by the
    sampling temperature (in fp32, as the engine does), so log-probs score the distribution
    the engine sampled from."""
    mask = micro_batch["attention_mask"]
    length = packing.length if packing is not None else mask.shape[1]
    if head == "scalar":
        per_position = {"values": output.squeeze(-1).float()}
    else:
        next_tokens = torch.roll(micro_batch["input_ids"], shifts=-1, dims=1)
        if packing is not None:  # a row's last output is about padding: zeroed below
            next_tokens = packing.pack(next_tokens)
        next_tokens = (used.select(next_tokens, 1) if cp_group is None
                       else split_for_rank(next_tokens, 1, cp_group.rank(), cp_group.size()))
        logprobs, entropy = vocab_parallel_logprobs_and_entropy(
            output, next_tokens, vocab_size, tp_group, temperature)
        per_position = {"logprobs": logprobs, "entropy": entropy}
    if cp_group is not None:
        per_position = {name: gather_per_token(tensor, cp_group)
                        for name, tensor in per_position.items()}
    per_position = {name: used.restore(tensor, length) for name, tensor in per_position.items()}
    if packing is not None:
        per_position = {name: packing.unpack(tensor) for name, tensor in per_position.items()}
    return {name: align_to_tokens(tensor, mask) for name, tensor in per_position.items()}


@dataclass(frozen=True)
class _UsedOutputs:
    """The positions whose outputs a micro-batch's caller uses, the only ones the output layer
    runs over: the columns from `first` on of a row-form micro-batch (its rows share columns),
    or the packed positions `index` of a packed one. The default is every position."""

    first: int = 0
    index: torch.Tensor | None = None
    """[t'] long: the used positions of the packed sequence, on the model's device."""

    @classmethod
    def of(cls, micro_batch: Batch, packing: PackedRows | None) -> "_UsedOutputs":
        """From the micro-batch's `output_mask` (host tensors): the output at t - 1 is about
        token t, so a position is used when the next token of its row is in the mask."""
        mask = micro_batch.get("output_mask")
        if mask is None or not mask.any():
            return cls()
        used = torch.zeros_like(mask, dtype=torch.bool)
        used[:, :-1] = (mask * micro_batch["attention_mask"])[:, 1:].bool()
        if packing is not None:
            return cls(index=packing.pack(used)[0].nonzero().squeeze(1))
        return cls(first=int(used.any(dim=0).nonzero()[0]))

    @property
    def every_position(self) -> bool:
        return self.first == 0 and self.index is None

    def to(self, device) -> "_UsedOutputs":
        return self if self.index is None else _UsedOutputs(index=self.index.to(device))

    def select(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """The used positions of `tensor` along its sequence dimension `dim`."""
        if self.index is not None:
            return tensor.index_select(dim, self.index)
        return tensor.narrow(dim, self.first, tensor.shape[dim] - self.first)

    def restore(self, tensor: torch.Tensor, length: int) -> torch.Tensor:
        """[b, used] outputs -> [b, length], 0 at the positions not used."""
        if self.index is None:
            return torch.nn.functional.pad(tensor, (length - tensor.shape[1], 0))
        full = tensor.new_zeros(tensor.shape[0], length)
        full[:, self.index] = tensor
        return full


def _used_outputs(micro_batch: Batch, packing: PackedRows | None, model,
                  cp_group) -> _UsedOutputs:
    """What the output layer of `model` runs over: the used positions (`_UsedOutputs.of`), or
    every position under context parallelism (a rank's positions are two chunks) or sequence
    parallelism (hidden states stay split along the sequence over the TP ranks until the output
    layer gathers them), and on stages without an output layer."""
    head = _output_layer(model)
    if cp_group is not None or head is None or head.sequence_parallel:
        return _UsedOutputs()
    return _UsedOutputs.of(micro_batch, packing)


def _output_layer(model):
    """The model's output layer: on the pipeline's last stage, else None."""
    from megatron.core.utils import unwrap_model

    return getattr(unwrap_model(model), "output_layer", None)


@contextmanager
def _output_layer_over(model, used: _UsedOutputs):
    """While open, the model's output layer sees hidden states [s, b, h] at the `used`
    positions only (`_used_outputs` gives every position where it has none)."""
    if used.every_position:
        yield
        return
    handle = _output_layer(model).register_forward_pre_hook(lambda _, args: (used.select(args[0], 0),
                                                             *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def _forward_step(head: str, vocab_size: int, temperature: float, pipeline: "_Pipeline",
                  loss_fn: LossFn | None, device: torch.device, routing: RoutingPass | None,
                  data_iterator, model):
    micro_batch = next(data_iterator)
    cp_group = pipeline.cp_group
    # Before the copy (no device sync): the packing of a packed micro-batch (host integers),
    # the positions whose outputs are used.
    packing, packed = _packing(micro_batch, model)
    used = _used_outputs(micro_batch, packing, model, cp_group).to(device)
    micro_batch = to_device(micro_batch, device)
    if packing is not None:
        if routing is not None:
            raise ValueError("packed micro-batches cannot replay or observe MoE routes "
                             "(routes are kept by row)")
    input_ids = micro_batch["input_ids"]
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    if packing is not None:  # positions restart per row (RoPE's from packed_seq_params)
        packing = packing.to(device)
        input_ids, positions = packing.pack(input_ids), packing.pack(positions)
    # What the model runs over, and how much of it is padding (a host integer and a device
    # scalar: averaged over micro-batches like the loss's metrics, their ratio is the pass's
    # padded share).
    positions_run = input_ids.numel()
    padded_positions = positions_run - micro_batch["attention_mask"].sum()
    if cp_group is not None:
        input_ids, positions = (split_for_rank(tensor, 1, cp_group.rank(), cp_group.size())
                                for tensor in (input_ids, positions))
    routers = routing.micro_batch(model, micro_batch) if routing else nullcontext()
    with _output_layer_over(model, used), routers:
        output = model(input_ids, positions, attention_mask=None,
                       **({"packed_seq_params": packed} if packed is not None else {}))

    def loss_func(output_tensor, non_loss_data: bool = False):
        outputs = _per_token_outputs(output_tensor, micro_batch, head, vocab_size, temperature,
                                     pipeline.tp_group, cp_group, packing, used)
        if non_loss_data:
            return {name: tensor.detach() for name, tensor in outputs.items()}
        numerator, denominator, metrics = loss_fn(outputs, micro_batch)
        device = numerator.device
        denominator = torch.as_tensor(denominator, dtype=torch.int, device=device)
        metrics = dict(metrics, loss_numerator=numerator.detach(),
                       loss_denominator=denominator.float(), forward_tokens=positions_run,
                       padded_tokens=padded_positions)
        if cp_group is not None and cp_group.rank() > 0:
            # Every CP rank computes the whole loss from the gathered outputs (its gradient
            # reaches its own positions only); Megatron sums the token counts over DP x CP.
            denominator = torch.zeros_like(denominator)
        return numerator, denominator, metrics

    return output, loss_func


def _micro_batches(chunks: list, batch: Batch, micro_batch_size: int, max_tokens: int
                   ) -> tuple[list[Batch], torch.Tensor | None, int]:
    """Fixed-size micro-batches, or with a token budget (max_tokens > 0) packed ones (rows
    back to back without padding, see batches.packed_micro_batches) where the model takes
    them (`_packing_refused`), else length-sorted ones of varying shapes (see
    batches.token_budget_micro_batches), then also the row order; followed by fillers
    (`_expert_group_fillers`); returns (micro-batches, order, how many are real: the
    schedule's results past those are the fillers', to drop)."""
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    config.variable_seq_lengths = max_tokens > 0
    length_multiple = _length_multiple(config)
    if max_tokens <= 0:
        micro_batches, order = split_micro_batches(batch, micro_batch_size), None
    elif not _packing_refused(config, batch):
        micro_batches, order = packed_micro_batches(batch, max_tokens, length_multiple)
        return micro_batches, order, len(micro_batches)
    else:
        micro_batches, order = token_budget_micro_batches(batch, max_tokens, length_multiple)
    micro_batches = [pad_columns_to_multiple(micro_batch, length_multiple,
                                             {"routed_experts": NO_ROUTE})
                     for micro_batch in micro_batches]
    fillers = (_expert_group_fillers(micro_batches, length_multiple, model_rank_of(chunks[0]))
               if max_tokens > 0 else [])
    return micro_batches + fillers, order, len(micro_batches)


def _packing_refused(config, batch: Batch) -> str | None:
    """Why a token-budget pass keeps padded rows instead of packing them (said once per
    reason), or None. Packing needs attention that takes Megatron's packed sequences (models/
    attention.py's SdpaAttention, or Transformer Engine's); with sequence parallelism the
    packed sequence ends on a multiple of the TP size. Context parallelism would need each
    sequence split into 2 x CP chunks (not built); an MoE model's routes are replayed and kept
    by row (not built), so MoE models keep rows."""
    reason = None
    if config.context_parallel_size > 1:
        reason = "context parallelism"
    elif config.num_moe_experts:
        reason = "a Mixture-of-Experts model (routes are replayed and kept by row)"
    elif "routed_experts" in batch or "row_ids" in batch:
        reason = "routes kept by row"
    if reason is not None:
        _say_unpacked(reason)
    return reason


@functools.cache
def _say_unpacked(reason: str) -> None:
    print0(f"note: token-budget micro-batches keep padded rows (no sequence packing) under "
           f"{reason}")


def _packing(micro_batch: Batch, model) -> tuple[PackedRows | None, object]:
    """A packed micro-batch's layout (host tensors) and Megatron's packed-sequence
    parameters for it, or (None, None) for a row-form one. `cu_seqlens` stay on the host for
    the unfused RoPE (which reads them with `.tolist()` in every layer) and go to the model's
    device for Transformer Engine's fused RoPE or attention."""
    if "pack_offsets" not in micro_batch:
        return None, None
    from megatron.core.utils import get_model_config

    from ..models.attention import SdpaAttention, packed_sequences

    config = get_model_config(model)
    packing = PackedRows.of(micro_batch, _length_multiple(config))
    on_device = config.apply_rope_fusion or not any(
        isinstance(module, SdpaAttention) for module in model.modules())
    cu_seqlens = packing.cu_seqlens(module_device(model) if on_device else None)
    return packing, packed_sequences(packing.segments, cu_seqlens)


def _length_multiple(config) -> int:
    """What a micro-batch's sequence length must be a multiple of: 2 x CP chunks, each split
    over the TP ranks with sequence parallelism."""
    cp = config.context_parallel_size
    return (2 * cp if cp > 1 else 1) * (config.tensor_model_parallel_size
                                        if config.sequence_parallel else 1)


def _expert_group_fillers(micro_batches: list[Batch], length: int, here: ModelRank
                          ) -> list[Batch]:
    """With experts split over ranks every forward exchanges tokens among the expert group, so
    its ranks must run equally many; a token budget gives each as many micro-batches as its
    rows' lengths need. The ranks with fewer run fillers up to the group's most: one row of
    `length` tokens copied from a real one (valid tokens and routes), every mask zeroed, so no
    loss, gradient or metric sees it. Their outputs are dropped (`_micro_batches`)."""
    if here.ep_size == 1:
        return []
    count = torch.tensor([len(micro_batches)], device=collective_device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=here.group("ep"))
    missing = int(count.item()) - len(micro_batches)  # one host read per pass
    if missing == 0:
        return []
    row = {name: tensor[:1, :length] if tensor.dim() > 1 else tensor[:1]
           for name, tensor in micro_batches[-1].items()}
    filler = {name: torch.zeros_like(tensor) if name.endswith("mask") else tensor
              for name, tensor in row.items()}
    return [filler] * missing


@dataclass
class _Pipeline:
    """Where a model's passes run: over the groups of the layout the model stage carries,
    resolved once per pass."""

    schedule: Callable
    """Megatron's forward-backward function, with the model's groups bound."""

    here: ModelRank
    """This rank in the model's layout."""

    tp_group: object
    pp_group: object
    cp_group: object
    """The context-parallel group, None at CP 1."""


def _pipeline(model) -> _Pipeline:
    """The pipeline of `model`: the schedule over the groups of the layout the stage carries
    (its P2P communicator and its groups go with every call; for the trained models these are
    Megatron's global groups, which the schedule would otherwise read itself)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.utils import get_model_config

    here = model_rank_of(model)
    own = {"pg_collection": here.groups}
    if here.pp_size > 1:
        own["p2p_communicator"] = P2PCommunicator(here.group("pp"), get_model_config(model))
    return _Pipeline(partial(get_forward_backward_func(pp_size=here.pp_size), **own), here,
                     here.group("tp"), here.group("pp"),
                     here.group("cp") if here.cp_size > 1 else None)


def _run_schedule(chunks: list, micro_batches: list[Batch], head: str, vocab_size: int,
                  temperature: float, loss_fn: LossFn | None, forward_only: bool,
                  pipeline: _Pipeline, routing: RoutingPass | None = None):
    if head == "lm" and vocab_size is None:
        raise ValueError("vocab_size (the real, unpadded vocabulary) is needed for an LM head")
    for micro_batch in micro_batches:
        check_batch(micro_batch)
    # With variable shapes (a token budget) Megatron sends each shape ahead between stages.
    batch_size, seq_length = micro_batches[0]["input_ids"].shape
    return pipeline.schedule(
        forward_step_func=partial(_forward_step, head, vocab_size, temperature, pipeline,
                                  loss_fn, module_device(chunks[0]), routing),
        data_iterator=iter(micro_batches),
        model=chunks,
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=batch_size,
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
    )


def _broadcast_from_last_stage(tensor: torch.Tensor | None, shape, device,
                               pipeline: _Pipeline) -> torch.Tensor:
    if dist.get_world_size(pipeline.pp_group) == 1:
        return tensor
    if tensor is None:
        tensor = torch.empty(shape, dtype=torch.float32, device=device)
    dist.broadcast(tensor, src=pipeline.here.last_stage_rank, group=pipeline.pp_group)
    return tensor


@torch.no_grad()
def compute_outputs(chunks: list, batch: Batch, micro_batch_size: int, head: str = "lm",
                    vocab_size: int | None = None, temperature: float = 1.0,
                    max_tokens: int = 0, routing: RoutingPass | None = None) -> dict:
    """Forward-only per-token outputs for this rank's rows of `batch` (all PP stages get them).
    head="lm" gives {'logprobs', 'entropy'} (of logits / temperature); head="scalar" gives
    {'values'}; each [n, s] fp32. max_tokens > 0: token-budget micro-batches instead of
    `micro_batch_size` rows. routing: what an MoE model's routers do in this pass (with
    keep_routes, the routes are kept by batch row). The passes run over the groups of the
    layout the model carries (its own, for a teacher)."""
    for chunk in chunks:
        chunk.eval()
    if routing is not None and routing.keep_routes:
        batch = dict(batch, row_ids=torch.arange(batch["input_ids"].shape[0]))
    micro_batches, order, real = _micro_batches(chunks, batch, micro_batch_size, max_tokens)
    pipeline = _pipeline(chunks[0])
    per_micro_batch = _run_schedule(chunks, micro_batches, head, vocab_size, temperature, None,
                                    True, pipeline, routing)[:real]
    names = ("values",) if head == "scalar" else ("logprobs", "entropy")
    return _per_row(per_micro_batch, names, order, batch, module_device(chunks[0]), pipeline)


def _per_row(per_micro_batch: list[dict], names: tuple[str, ...], order: torch.Tensor | None,
             batch: Batch, device, pipeline: _Pipeline) -> dict:
    """The micro-batches' per-token outputs `names` as [n, s] tensors in the batch's row order,
    on every stage of the pipeline, on the device of the batch."""
    shape = tuple(batch["input_ids"].shape)
    results = {}
    for name in names:
        local = _in_batch_order([out[name] for out in per_micro_batch], order, shape) \
            if pipeline.here.is_last_stage else None
        broadcast = _broadcast_from_last_stage(local, shape, device, pipeline)
        results[name] = broadcast.to(batch["input_ids"].device)
    return results


def _in_batch_order(outputs: list[torch.Tensor], order: torch.Tensor | None,
                    shape: tuple) -> torch.Tensor:
    """Per-micro-batch [b_i, s_i] outputs as one [n, s] tensor in the batch's row order (columns
    padded for CP or SP dropped)."""
    outputs = [out[:, :shape[1]] for out in outputs]
    if order is None:
        return torch.cat(outputs)
    result = outputs[0].new_zeros(shape)
    padded = [torch.nn.functional.pad(out, (0, shape[1] - out.shape[1])) for out in outputs]
    result[order.to(result.device)] = torch.cat(padded)
    return result


def train_step(model: TrainableModel, batch: Batch, micro_batch_size: int, loss_fn: LossFn,
               head: str = "lm", vocab_size: int | None = None,
               temperature: float = 1.0, max_tokens: int = 0,
               routing: RoutingPass | None = None, per_token: tuple[str, ...] = ()) -> dict:
    """One optimizer step on this rank's rows of `batch` (micro-batches of `micro_batch_size`
    rows, or of at most `max_tokens` tokens when > 0). Returns metrics identical on every
    rank: the global loss (sum of numerators / sum of denominators over DP), the loss function's
    metrics (mean over micro-batches and DP ranks), grad norm, LR, and whether the update was
    skipped because the loss or a gradient was not finite (then nothing changes). routing: what
    an MoE model's routers do in this step (replay the batch's routes). per_token: names of
    per-token [b, s] metrics the loss function returns, given back as [n, s] tensors in the
    batch's row order on every pipeline stage instead of being averaged."""
    for chunk in model.chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    model.optimizer.zero_grad()
    micro_batches, order, real = _micro_batches(model.chunks, batch, micro_batch_size,
                                                max_tokens)
    pipeline = _pipeline(model.chunks[0])
    per_micro_batch = _run_schedule(model.chunks, micro_batches, head, vocab_size, temperature,
                                    loss_fn, False, pipeline, routing)[:real]
    rows = _per_row(per_micro_batch, per_token, order, batch, module_device(model.chunks[0]),
                    pipeline)
    for metrics in per_micro_batch:
        for name in per_token:
            del metrics[name]
    metrics = _reduce_metrics(per_micro_batch, pipeline.here)
    finite = math.isfinite(metrics["loss"]) and _gradients_finite(model.chunks)
    updated, grad_norm = False, float("nan")
    if finite:
        updated, grad_norm, _ = model.optimizer.step()
    if updated:
        model.scheduler.step(increment=1)
    metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                   lr=model.optimizer.param_groups[0]["lr"], update_skipped=not updated,
                   **rows)
    return metrics


def _gradients_finite(chunks: list) -> bool:
    """True when every rank's reduced gradients are finite (checked before the optimizer step,
    since Megatron only checks for inf/nan when a loss scaler is in use). One reduction per
    gradient on its device, one all-reduce, one host synchronisation per step."""
    grads = [param.main_grad for chunk in chunks for param in chunk.parameters()
             if getattr(param, "main_grad", None) is not None]
    bad = torch.zeros(1, device=collective_device())
    if grads:
        finite = torch.stack([torch.isfinite(grad).all() for grad in grads]).all()
        bad = (~finite).to(device=bad.device, dtype=bad.dtype).reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad.item())


def _reduce_metrics(per_micro_batch: list[dict], here: ModelRank) -> dict:
    """Global loss and mean loss-function metrics, computed on the last stage over the DP group
    and sent to the other stages."""
    reduced = None
    if here.is_last_stage:
        names = sorted(name for name in per_micro_batch[0]
                       if name not in ("loss_numerator", "loss_denominator"))
        group = here.group("dp")
        device = collective_device(group)
        totals = torch.zeros(3 + len(names), dtype=torch.float64, device=device)
        for metrics in per_micro_batch:
            totals[0] += metrics["loss_numerator"].double().to(device)
            totals[1] += metrics["loss_denominator"].double().to(device)
            totals[2] += 1
            for index, name in enumerate(names):
                totals[3 + index] += torch.as_tensor(metrics[name], device=device).double()
        dist.all_reduce(totals, group=group)
        reduced = {"loss": (totals[0] / totals[1].clamp(min=1)).item()}
        reduced.update({name: (totals[3 + index] / totals[2]).item()
                        for index, name in enumerate(names)})
    if here.pp_size > 1:
        holder = [reduced]
        dist.broadcast_object_list(holder, src=here.last_stage_rank, group=here.group("pp"))
        reduced = holder[0]
    return reduced
