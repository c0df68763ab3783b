"""Megatron DDP, distributed optimizer and LR schedule for one trained model.

Wiring that every trained role (actor, critic) shares: the model is wrapped in Megatron's
DistributedDataParallel (contiguous grad buffers, fp32 grad reduction), the optimizer is
Megatron's Adam with fp32 master weights (sharded over DP when `use_distributed_optimizer`),
and the TransformerConfig gets the hooks the pipeline schedules call (no_sync, grad scaling,
finalize_model_grads, which also all-reduces tied-embedding grads between first and last stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import OptimizerConfig
from ..config.runtime import resolve_precision
from ..models.transformer_config import DTYPES


@dataclass
class TrainableModel:
    """A model stage ready to train: the DDP-wrapped chunks, their optimizer and LR schedule."""

    chunks: list
    """DDP-wrapped model chunks of this rank (one per virtual pipeline stage; one today)."""

    optimizer: object
    """Megatron optimizer over all chunks."""

    scheduler: object
    """Megatron OptimizerParamScheduler driving the LR."""

    base: Optional[dict] = None
    """With adapters: the identity of the frozen base they train on
    (checkpoint.base_identity), which a training-state checkpoint records and a resume checks;
    None: every weight trains."""


def inner_optimizers(optimizer) -> list:
    """The Megatron optimizers inside a (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def wrap_in_ddp(model, use_distributed_optimizer: bool):
    """Megatron DDP around one model chunk (grads reduced in fp32, no overlap)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer(chunks: list, optim: OptimizerConfig, precision: str):
    """Megatron Adam over the chunks' parameters, with dynamic loss scaling for fp16."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    precision = resolve_precision(precision)
    megatron_config = MegatronOptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=DTYPES[precision],
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    return get_megatron_optimizer(megatron_config, chunks)


def build_scheduler(optimizer, optim: OptimizerConfig):
    """Warm-up then decay; `lr_decay_steps=0` keeps the LR constant after warm-up."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decays = optim.lr_decay_steps > 0 and optim.lr_decay_style != "constant"
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.lr_warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=optim.lr_warmup_steps + (optim.lr_decay_steps if decays else 1),
        lr_decay_style=optim.lr_decay_style if decays else "constant",
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )


def make_trainable(model, optim: OptimizerConfig, precision: str,
                   base: Optional[dict] = None) -> TrainableModel:
    """Wrap, build the optimizer and schedule, and install the schedule hooks on the config.
    base: the frozen base's identity when the model trains adapters (TrainableModel.base)."""
    from megatron.core.distributed import finalize_model_grads

    chunk = wrap_in_ddp(model, optim.use_distributed_optimizer)
    optimizer = build_optimizer([chunk], optim, precision)
    config = model.config
    config.no_sync_func = chunk.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return TrainableModel(chunks=[chunk], optimizer=optimizer,
                          scheduler=build_scheduler(optimizer, optim), base=base)

