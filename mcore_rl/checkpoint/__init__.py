"""Checkpoints as Megatron-Core distributed checkpoints with layout-independent keys and shapes,
written atomically (`<dir>.incomplete`, renamed when complete)."""

from .weights_io import (RankCoordinates, is_checkpoint, load_weights_into, megatron_coordinates,
                         read_metadata, save_weights)

__all__ = ["RankCoordinates", "is_checkpoint", "load_weights_into", "megatron_coordinates",
           "read_metadata", "save_weights"]
