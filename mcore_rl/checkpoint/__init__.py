"""Checkpoints as Megatron-Core distributed checkpoints, written atomically (`<dir>.incomplete`,
renamed when complete): weights with layout-independent keys and shapes (weights_io), and the
complete training state for resuming a run (training_state)."""

from .training_state import latest_checkpoint, load_latest_training_state, save_training_state
from .weights_io import (RankCoordinates, is_checkpoint, load_weights_into, megatron_coordinates,
                         read_metadata, save_weights)

__all__ = ["RankCoordinates", "is_checkpoint", "latest_checkpoint", "load_latest_training_state",
           "load_weights_into", "megatron_coordinates", "read_metadata", "save_training_state",
           "save_weights"]
