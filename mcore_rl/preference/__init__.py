"""Learning from preference pairs: a Bradley-Terry reward model (`mcore-rl rm`) and DPO/IPO
(`mcore-rl dpo`), beside SFT and RL."""

from .api import make_preference_config
from .trainer import HF_DIR, MODEL_DIR, DpoTrainer, RewardModelTrainer

__all__ = ["DpoTrainer", "HF_DIR", "MODEL_DIR", "RewardModelTrainer", "make_preference_config"]
