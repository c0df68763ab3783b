"""Weight checkpoints as Megatron-Core distributed checkpoints, written atomically
(`<dir>.incomplete`, renamed when complete), with layout-independent keys and shapes: any
TP x PP layout reads what any other wrote (weights_io, sharded_weights). The complete training
state of a run (optimizer, RNG, sampler) is saved by training.checkpointer."""

from .weights_io import is_checkpoint, load_weights_into, read_metadata, save_weights

__all__ = ["is_checkpoint", "load_weights_into", "read_metadata", "save_weights"]
