"""RL training: the step, the loop and the Python API (`make_trainer_config`, `Trainer`)."""

from mcore_rl.runtime.preemption import PREEMPTED_EXIT_CODE

from .api import make_trainer_config
from .run import run_training
from .step_guards import RewardsFailed, TrainingDiverged
from .trainer import Experience, Trainer

__all__ = ["PREEMPTED_EXIT_CODE", "Experience", "RewardsFailed", "Trainer", "TrainingDiverged",
           "make_trainer_config", "run_training"]
