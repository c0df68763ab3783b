"""RL training: the step, the loop and the Python API (`make_trainer_config`, `Trainer`)."""

from .api import make_trainer_config
from mcore_rl.runtime.preemption import PREEMPTED_EXIT_CODE
from .trainer import Experience, Trainer, TrainingDiverged

__all__ = ["PREEMPTED_EXIT_CODE", "Experience", "Trainer", "TrainingDiverged", "make_trainer_config"]
