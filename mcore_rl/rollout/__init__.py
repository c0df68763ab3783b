"""Rollout: the generation side of the RL step."""

from .prompts import PreparedPrompts, PromptError, prepare_prompts

__all__ = ["PreparedPrompts", "PromptError", "prepare_prompts"]
