"""Forward/backward through Megatron's pipeline schedules, DDP and the distributed optimizer."""

from .batches import Batch, check_batch, shard_for_data_parallel, split_micro_batches
from .forward_backward import compute_outputs, train_step
from .optimizer import TrainableModel, make_trainable

__all__ = ["Batch", "TrainableModel", "check_batch", "compute_outputs", "make_trainable",
           "shard_for_data_parallel", "split_micro_batches", "train_step"]
