"""Supervised fine-tuning on demonstrations (`mcore-rl sft`), the warm-up before RL."""

from .trainer import MODEL_DIR, run_sft, sft_loss

__all__ = ["MODEL_DIR", "run_sft", "sft_loss"]
